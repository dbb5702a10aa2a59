"""What every harness adapter provides: pinned install spec, config, command line, environment, outputs.

A harness is an unmodified coding-agent CLI. The adapter knows only how to install it at a pinned
version, how to point it at the capture proxy from a fresh HOME, how to start it headless and how
to read its own log afterwards. Everything per-agent lives in the one module of that agent.
"""

from __future__ import annotations

import os
import pwd
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, TypedDict

from fineenvs.api_formats import ApiFormat
from fineenvs.harnesses.files import iter_json_lines, json_from, read_text, write_config_file
from fineenvs.harnesses.node import NODE, compile_cache_dir
from fineenvs.harnesses.pins import PINS
from fineenvs.jsonl import JsonObject
from fineenvs.paths import harness_cache, installed_version, read_marker

Registry = Literal["npm", "pypi"]

API_FORMATS = tuple(f.value for f in ApiFormat)


class HarnessConfigError(ValueError):
    """A harness was asked for something it cannot do (unknown format, bad base URL)."""


@dataclass(frozen=True)
class Outputs:
    """What the agent's own output/log says about the attempt."""

    final_text: str | None
    native_tool_calls: int | None
    detail: str = ""


def node_bin_dir() -> str:
    """Directory of the pinned node executable the npm harnesses run on (fineenvs/harnesses/node.py)."""
    return str(NODE.bin_dir)


def strip_v1(base_url: str) -> str:
    """The server root of a proxy base URL: clients that append ``/v1`` themselves need it."""
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def with_v1(base_url: str) -> str:
    return strip_v1(base_url) + "/v1"


def sdk_base_url(fmt: str, base_url: str) -> str:
    """The proxy's base URL as a format's official client wants it: the OpenAI clients with ``/v1``,
    the Anthropic and Google ones without (they append their API version themselves)."""
    appends_version = fmt in (ApiFormat.anthropic_messages, ApiFormat.gemini)
    return strip_v1(base_url) if appends_version else with_v1(base_url)


# The variables the official OpenAI, Anthropic and Google clients read their key and endpoint from.
SDK_KEY_ENV: dict[str, str] = {
    ApiFormat.openai_chat: "OPENAI_API_KEY",
    ApiFormat.openai_responses: "OPENAI_API_KEY",
    ApiFormat.anthropic_messages: "ANTHROPIC_API_KEY",
    ApiFormat.gemini: "GEMINI_API_KEY",
}
SDK_URL_ENV: dict[str, str] = {
    ApiFormat.openai_chat: "OPENAI_BASE_URL",
    ApiFormat.openai_responses: "OPENAI_BASE_URL",
    ApiFormat.anthropic_messages: "ANTHROPIC_BASE_URL",
    ApiFormat.gemini: "GOOGLE_GEMINI_BASE_URL",
}
# litellm's own switches: its bundled model price list instead of a download, no telemetry.
LITELLM_OFFLINE = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False"}
# litellm's provider prefix of a model name picks its client.
LITELLM_PROVIDER: dict[str, str] = {
    ApiFormat.openai_chat: "openai",
    ApiFormat.anthropic_messages: "anthropic",
}


def litellm_model(fmt: str, model: str) -> str:
    """The served model as litellm names it for ``fmt`` (Chat or Messages)."""
    return f"{LITELLM_PROVIDER[fmt]}/{model}"


@dataclass(frozen=True)
class Launch:
    """One attempt's launch as an adapter sees it: where its home and work folder are, the proxy it
    talks to and with which session key, the served model, the wire format, its step limit and its
    task. ``write_config`` gets the host's paths (where the files are written); ``command`` and
    ``env`` get the paths the agent sees (fixed ones inside the bwrap sandbox: ``seen_as``)."""

    home: Path
    workdir: Path
    base_url: str
    session_key: str
    model: str
    api_format: str
    step_limit: int | None = None
    task_prompt: str = ""

    def seen_as(self, home: Path, workdir: Path) -> Launch:
        return replace(self, home=home, workdir=workdir)

    def step_args(self, flag: str) -> list[str]:
        """``flag`` and the step limit, for an agent that takes it on its command line (none unset)."""
        return [] if self.step_limit is None else [flag, str(self.step_limit)]


def sdk_env(launch: Launch, fmt: str, url_env: dict[str, str] = SDK_URL_ENV) -> dict[str, str]:
    """The session key and the proxy's URL in the variables ``fmt``'s client reads them from
    (``url_env`` where the agent names the URL's variable otherwise, as litellm does)."""
    return {SDK_KEY_ENV[fmt]: launch.session_key, url_env[fmt]: sdk_base_url(fmt, launch.base_url)}


class Description(TypedDict):
    """A harness as ``python -m fineenvs.harnesses list`` shows it."""

    name: str
    package: str
    registry: Registry
    version: str
    installed: bool
    path: str
    formats: list[str]
    default_format: str


class Harness(ABC):
    """One coding-agent CLI at a pinned version.

    Subclasses set the class attributes and implement ``arguments``, and name what else differs:
    the config files (:meth:`config_files`, or ``write_config`` where a dict will not do) and the
    agent's variables (:meth:`agent_env`), which ``env`` adds on top of :meth:`base_env`, built
    from scratch so the parent's API keys and other secrets never reach the agent.
    """

    name: str  # its pin in PINS (fineenvs/harnesses/pins.py): package, version, binary, formats
    registry: Registry
    # Extra requirements installed next to the package (pypi: pins that keep the agent working).
    extra_requirements: tuple[str, ...] = ()
    # Whether the agent honours a step limit we can set (only then is step_limit passed through).
    honours_step_limit: bool = False
    # Agents that act through text formats (file edits written out in the reply) instead of tool
    # calls: the proxy sees no tool calls, so their own trace is the only count of their actions.
    actions_in_text: bool = False
    # PyPI agents whose releases need a newer Python than the project's name it here ("3.12").
    python_version: str | None = None

    @property
    def package(self) -> str:
        return PINS[self.name].package

    @property
    def version(self) -> str:
        return PINS[self.name].version

    @property
    def binary(self) -> str:
        return PINS[self.name].binary

    @property
    def api_formats(self) -> tuple[str, ...]:
        """The formats the agent speaks, the one it speaks unless told otherwise first."""
        return PINS[self.name].api_formats

    @property
    def default_format(self) -> str:
        return self.api_formats[0]

    # ------------------------------------------------------------------ install layout
    @property
    def install_dir(self) -> Path:
        return harness_cache() / f"{self.name}-{self.version}"

    @property
    def bin_dir(self) -> Path:
        if self.registry == "npm":
            return self.install_dir / "node_modules" / ".bin"
        return self.install_dir / "venv" / "bin"

    @property
    def binary_path(self) -> Path:
        return self.bin_dir / self.binary

    def install_requirements(self) -> list[str]:
        """The requirement strings handed to npm/pip."""
        sep = "@" if self.registry == "npm" else "=="
        return [f"{self.package}{sep}{self.version}", *self.extra_requirements]

    def install_command_hint(self) -> str:
        return f"python -m fineenvs.harnesses install {self.name}"

    def post_install(self, prefix: Path) -> list[tuple[list[str], dict[str, str]]]:
        """Commands (argv, complete environment) run once after the package landed in ``prefix``.

        ``prefix`` is the temporary directory the installer renames to :attr:`install_dir` when
        every command succeeded, so paths must be built from it, not from ``install_dir``.
        """
        return []

    def warm_argv(self) -> list[str]:
        """A quick start of the agent that loads its code: run once after install, outside any
        sandbox, to fill an npm agent's compile cache (fineenvs/harnesses/node.py)."""
        return [str(self.binary_path), "--version"]

    def installed_version(self) -> str | None:
        return installed_version(self.install_dir)

    def installed_requirements(self) -> list[str] | None:
        """What the install was made from (the marker's record; None where it has none)."""
        reqs = read_marker(self.install_dir).get("requirements")
        return [str(r) for r in reqs] if isinstance(reqs, list) else None

    def is_installed(self) -> bool:
        reqs = self.installed_requirements()
        return (
            self.installed_version() == self.version
            and self.binary_path.exists()
            and reqs in (None, self.install_requirements())
        )

    # ------------------------------------------------------------------ per attempt
    def check_format(self, api_format: str) -> str:
        fmt = api_format or self.default_format
        if fmt not in self.api_formats:
            raise HarnessConfigError(
                f"harness {self.name!r} cannot speak api_format {fmt!r}: it supports "
                f"{', '.join(self.api_formats)}; set harness api_format to one of those"
            )
        return fmt

    def write_config(self, launch: Launch) -> None:
        """Write the agent's config files under ``home`` (and ``workdir`` where it reads them)."""
        fmt = self.check_format(launch.api_format)
        for rel, document in self.config_files(launch, fmt).items():
            write_config_file(launch.home / rel, document)

    def config_files(self, launch: Launch, fmt: str) -> dict[str, JsonObject]:
        """The agent's config files, by their path under HOME (a ``.toml`` one written as TOML,
        any other as JSON, which is valid YAML too), for the checked format ``fmt``."""
        return {}

    def command(self, launch: Launch) -> list[str]:
        """The argv that runs the agent headless on one task."""
        return [str(self.binary_path), *self.arguments(launch)]

    @abstractmethod
    def arguments(self, launch: Launch) -> list[str]:
        """The agent's arguments for one task (step_limit where a flag honours it)."""

    def env(self, launch: Launch) -> dict[str, str]:
        """The agent's complete environment (built from scratch; see :meth:`base_env`)."""
        return {**self.base_env(launch.home), **self.agent_env(launch)}

    def agent_env(self, launch: Launch) -> dict[str, str]:
        """The agent's own variables (its key, endpoint and switches) on top of :meth:`base_env`."""
        return {}

    def base_env(self, home: Path) -> dict[str, str]:
        """PATH/HOME/locale only: nothing from the parent except what is listed here."""
        path = [str(self.bin_dir), node_bin_dir(), "/usr/local/bin", "/usr/bin", "/bin"]
        seen: list[str] = []
        for entry in path:
            if entry not in seen:
                seen.append(entry)
        tmp = home / "tmp"
        node = (
            {"NODE_COMPILE_CACHE": str(compile_cache_dir(self.install_dir))} if self.registry == "npm" else {}
        )
        return {
            **node,
            "PATH": os.pathsep.join(seen),
            "HOME": str(home),
            "USER": _user_name(),
            "LOGNAME": _user_name(),
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "TERM": "dumb",
            "NO_COLOR": "1",
            "TMPDIR": str(tmp),
            "XDG_CONFIG_HOME": str(home / ".config"),
            "XDG_CACHE_HOME": str(home / ".cache"),
            "XDG_DATA_HOME": str(home / ".local" / "share"),
            "XDG_STATE_HOME": str(home / ".local" / "state"),
            "DO_NOT_TRACK": "1",
            "CI": "1",
        }

    def parse_outputs(self, attempt_dir: Path) -> Outputs:
        """Final text and the agent's own tool-call count (None where it keeps no log)."""
        stdout = read_text(attempt_dir / "stdout.txt")
        text = stdout.strip() or None
        return Outputs(final_text=text, native_tool_calls=None, detail="stdout only")

    def describe(self) -> Description:
        return {
            "name": self.name,
            "package": self.package,
            "registry": self.registry,
            "version": self.version,
            "installed": self.is_installed(),
            "path": str(self.install_dir),
            "formats": list(self.api_formats),
            "default_format": self.default_format,
        }


def _user_name() -> str:
    """The account name from the password database (not the parent's $USER)."""
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return "agent"


class NpmHarness(Harness):
    """An agent from npm, run on the pinned Node, that prints its run as JSON lines on stdout
    (``output_detail`` says which flag asks for them): :meth:`read_events` reads them."""

    registry: Registry = "npm"
    output_detail: str

    def parse_outputs(self, attempt_dir: Path) -> Outputs:
        events = self.stdout_events(read_text(attempt_dir / "stdout.txt"))
        final, tool_calls = self.read_events(events)
        return Outputs(
            final_text=final, native_tool_calls=tool_calls if events else None, detail=self.output_detail
        )

    def stdout_events(self, stdout: str) -> list[JsonObject]:
        return iter_json_lines(stdout)

    @abstractmethod
    def read_events(self, events: list[JsonObject]) -> tuple[str | None, int | None]:
        """The final text and the tool calls the agent's events report (None: they cannot tell)."""


class PypiHarness(Harness):
    """An agent from PyPI, in its own venv (``python_version`` where it needs a newer Python)."""

    registry: Registry = "pypi"


def transcript_outputs(
    stdout: str, read: Callable[[list[JsonObject]], tuple[str | None, int]], *, detail: str, missing: str
) -> Outputs:
    """Outputs of an agent that prints its transcript as one JSON array: what ``read`` finds in its
    objects, or the plain stdout where it printed none (``missing`` says so in the detail)."""
    entries = json_from(stdout, "[")
    if not isinstance(entries, list):
        return Outputs(final_text=stdout.strip() or None, native_tool_calls=None, detail=missing)
    final, tool_calls = read([e for e in entries if isinstance(e, dict)])
    return Outputs(final_text=final, native_tool_calls=tool_calls, detail=detail)
