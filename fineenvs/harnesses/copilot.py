"""GitHub Copilot CLI (``@github/copilot``): Chat, Responses or Messages through its BYOK provider.

``COPILOT_PROVIDER_BASE_URL`` switches the CLI to a custom provider ("bring your own key"): no
GitHub login, and with ``COPILOT_OFFLINE=true`` no GitHub traffic at all (authentication,
telemetry, GitHub MCP server, web tools and auto-update off). ``COPILOT_PROVIDER_TYPE`` picks the
client (``openai`` or ``anthropic``) and ``COPILOT_PROVIDER_WIRE_API`` the OpenAI format
(``completions`` or ``responses``).

The npm package holds a native single-executable binary that unpacks its JavaScript (~235 MB)
into a package cache on first start; the install step unpacks it once into the install directory
(``COPILOT_SEA_EXTRACT_ONLY``), so attempts with a fresh HOME do not each unpack it again.

``Copilot(transport="websocket")`` sends Responses over the Responses WebSocket
(``COPILOT_PROVIDER_TRANSPORT=websockets``, served by :mod:`fineenvs.proxy.websocket`); the
default is the CLI's own, HTTP.

Not covered: a step limit (the CLI has none; ``--max-autopilot-continues`` counts continuation
messages of autopilot mode, ``--max-ai-credits`` GitHub billing units).
"""

from __future__ import annotations

from pathlib import Path

from fineenvs.api_formats import ApiFormat
from fineenvs.harnesses.base import HarnessConfigError, Launch, NpmHarness, node_bin_dir, sdk_base_url
from fineenvs.jsonl import JsonObject

PKG_CACHE = "pkg-cache"
TYPE_BY_FORMAT: dict[str, str] = {
    ApiFormat.openai_chat: "openai",
    ApiFormat.openai_responses: "openai",
    ApiFormat.anthropic_messages: "anthropic",
}
# Every tool on every path without a question: nobody is there to answer.
PERMISSION_FLAGS = ("--allow-all-tools", "--allow-all-paths", "--no-ask-user")
# Nothing from GitHub or the user's setup: no update, telemetry, instruction files or built-in MCPs.
OFFLINE_FLAGS = ("--no-auto-update", "--disable-client-telemetry")
SETUP_FLAGS = ("--no-custom-instructions", "--disable-builtin-mcps")
HEADLESS_FLAGS = (*PERMISSION_FLAGS, *OFFLINE_FLAGS, *SETUP_FLAGS, "--output-format", "json")


class Copilot(NpmHarness):
    name = "copilot"
    output_detail = "--output-format json"

    def __init__(self, transport: str = "http") -> None:
        if transport not in ("http", "websocket"):
            raise HarnessConfigError(f"copilot transport {transport!r} is unknown: use http or websocket")
        self.transport = transport

    def check_format(self, api_format: str) -> str:
        fmt = super().check_format(api_format)
        if self.transport == "websocket" and fmt != ApiFormat.openai_responses:
            raise HarnessConfigError(
                f"copilot speaks {fmt} over HTTP only: its WebSocket transport carries Responses; "
                "set api_format=openai_responses or use the http transport"
            )
        return fmt

    def post_install(self, prefix: Path) -> list[tuple[list[str], dict[str, str]]]:
        env = {
            "PATH": f"{node_bin_dir()}:/usr/bin:/bin",
            "HOME": str(prefix / "install-home"),
            "COPILOT_SEA_EXTRACT_ONLY": "1",
            "COPILOT_PKG_CACHE_HOME": str(prefix / PKG_CACHE),
        }
        return [([str(prefix / "node_modules" / ".bin" / self.binary), "--binary-version"], env)]

    def write_config(self, launch: Launch) -> None:
        self.check_format(launch.api_format)
        # Everything is in the environment; the home only needs to exist.
        (launch.home / ".copilot").mkdir(parents=True, exist_ok=True)

    def arguments(self, launch: Launch) -> list[str]:
        dirs = ["--log-dir", str(launch.home / ".copilot" / "logs"), "-C", str(launch.workdir)]
        return ["-p", launch.task_prompt, "--model", launch.model, *HEADLESS_FLAGS, *dirs]

    def agent_env(self, launch: Launch) -> dict[str, str]:
        fmt = self.check_format(launch.api_format)
        env = {
            "COPILOT_HOME": str(launch.home / ".copilot"),
            "COPILOT_PKG_CACHE_HOME": str(self.install_dir / PKG_CACHE),
            "COPILOT_OFFLINE": "true",
            "COPILOT_AUTO_UPDATE": "false",
            "COPILOT_MODEL": launch.model,
            "COPILOT_PROVIDER_TYPE": TYPE_BY_FORMAT[fmt],
            "COPILOT_PROVIDER_BASE_URL": sdk_base_url(fmt, launch.base_url),
            "COPILOT_PROVIDER_API_KEY": launch.session_key,
            "COPILOT_PROVIDER_MAX_PROMPT_TOKENS": "200000",
            "COPILOT_PROVIDER_MAX_OUTPUT_TOKENS": "8192",
        }
        if fmt != ApiFormat.anthropic_messages:
            wire_api = "responses" if fmt == ApiFormat.openai_responses else "completions"
            env["COPILOT_PROVIDER_WIRE_API"] = wire_api
        if self.transport == "websocket":
            env["COPILOT_PROVIDER_TRANSPORT"] = "websockets"
        return env

    def read_events(self, events: list[JsonObject]) -> tuple[str | None, int | None]:
        tool_calls = 0
        final: str | None = None
        for ev in events:
            data = ev.get("data")
            if ev.get("type") != "assistant.message" or not isinstance(data, dict):
                continue
            requests = data.get("toolRequests")
            tool_calls += len(requests) if isinstance(requests, list) else 0
            content = data.get("content")
            if isinstance(content, str) and content.strip():
                final = content
        return final, tool_calls
