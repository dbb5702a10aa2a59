"""What every harness adapter provides: pinned install spec, config, command line, environment, outputs.

A harness is an unmodified coding-agent CLI. The adapter knows only how to install it at a pinned
version, how to point it at the capture proxy from a fresh HOME, how to start it headless and how
to read its own log afterwards. Everything per-agent lives in the one module of that agent.
"""

from __future__ import annotations

import json
import os
import pwd
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from fineenvs.harnesses.node import NODE, compile_cache_dir
from fineenvs.paths import harness_cache, installed_version, read_marker

Registry = Literal["npm", "pypi"]

# The four wire formats the proxy speaks (names match fineenvs.dialects).
OPENAI_CHAT = "openai_chat"
OPENAI_RESPONSES = "openai_responses"
ANTHROPIC_MESSAGES = "anthropic_messages"
GEMINI = "gemini"
API_FORMATS = (OPENAI_CHAT, OPENAI_RESPONSES, ANTHROPIC_MESSAGES, GEMINI)


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


class Harness(ABC):
    """One coding-agent CLI at a pinned version.

    Subclasses set the class attributes and implement ``write_config`` and ``command``; ``env``
    adds agent-specific variables on top of :meth:`base_env`, which is built from scratch so the
    parent's API keys and other secrets never reach the agent.
    """

    name: str
    package: str
    registry: Registry
    version: str
    binary: str
    api_formats: tuple[str, ...]
    default_format: str
    # Extra requirements installed next to the package (pypi: pins that keep the agent working).
    extra_requirements: tuple[str, ...] = ()
    # Whether the agent honours a step limit we can set (only then is step_limit passed through).
    honours_step_limit: bool = False
    # Agents that act through text formats (file edits written out in the reply) instead of tool
    # calls: the proxy sees no tool calls, so their own trace is the only count of their actions.
    actions_in_text: bool = False
    # PyPI agents whose releases need a newer Python than the project's name it here ("3.12").
    python_version: str | None = None

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

    @abstractmethod
    def write_config(self, launch: Launch) -> None:
        """Write the agent's config files under ``home`` (and ``workdir`` where it reads them)."""

    @abstractmethod
    def command(self, launch: Launch) -> list[str]:
        """The argv that runs the agent headless on one task (step_limit where a flag honours it)."""

    def env(self, launch: Launch) -> dict[str, str]:
        """The agent's complete environment (built from scratch; see :meth:`base_env`)."""
        return self.base_env(launch.home)

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

    def describe(self) -> dict[str, Any]:
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


def read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def iter_json_lines(text: str) -> list[dict[str, Any]]:
    """The JSON objects among the lines of ``text`` (non-JSON lines skipped)."""
    out: list[dict[str, Any]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out
