"""Codex (``@openai/codex``): OpenAI Responses over its default WebSocket transport, or HTTP.

Default (``transport="websocket"``): Codex's built-in ``openai`` provider with ``openai_base_url``
pointed at the proxy, as a user would configure it. Codex then speaks the Responses WebSocket
(``GET /v1/responses`` upgrade, ``response.create`` frames, incremental input after a warm-up;
served by :mod:`fineenvs.proxy.websocket`) and keeps HTTPS only as its fallback. The key goes in
``CODEX_API_KEY``, which ``codex exec`` reads for the built-in provider.

``transport="http"``: a custom provider (``model_providers.fineenvs``, ``wire_api = "responses"``),
which never tries the WebSocket and posts every turn with its full history.
"""

from __future__ import annotations

from fineenvs.harnesses.base import HarnessConfigError, Launch, NpmHarness, with_v1
from fineenvs.jsonl import JsonObject

KEY_ENV = "FINEENVS_SESSION_KEY"
# codex exec's own variable for the built-in provider's API key.
CODEX_KEY_ENV = "CODEX_API_KEY"
TRANSPORTS = ("websocket", "http")
HEADLESS_FLAGS = ("exec", "--json", "--dangerously-bypass-approvals-and-sandbox", "--skip-git-repo-check")


class Codex(NpmHarness):
    name = "codex"
    output_detail = "exec --json"

    def __init__(self, transport: str = "websocket") -> None:
        if transport not in TRANSPORTS:
            raise HarnessConfigError(
                f"codex transport {transport!r} is unknown: use one of {', '.join(TRANSPORTS)}"
            )
        self.transport = transport

    def config_files(self, launch: Launch, fmt: str) -> dict[str, JsonObject]:
        if self.transport == "websocket":
            # The built-in provider, only its base URL moved: Codex's default transport.
            provider: JsonObject = {"openai_base_url": with_v1(launch.base_url)}
        else:
            # A custom provider (not the built-in `openai`) never tries the WebSocket.
            custom = {
                "name": "fineenvs",
                "base_url": with_v1(launch.base_url),
                "env_key": KEY_ENV,
                "wire_api": "responses",
                "request_max_retries": 1,
                "stream_max_retries": 1,
            }
            provider = {"model_provider": "fineenvs", "model_providers": {"fineenvs": custom}}
        config = {
            "model": launch.model,
            "check_for_update_on_startup": False,
            "approval_policy": "never",
            "sandbox_mode": "danger-full-access",
            **provider,
            "analytics": {"enabled": False},
            "features": {"plugins": False},
            "history": {"persistence": "none"},
        }
        return {".codex/config.toml": config}

    def arguments(self, launch: Launch) -> list[str]:
        return [*HEADLESS_FLAGS, "-C", str(launch.workdir), launch.task_prompt]

    def agent_env(self, launch: Launch) -> dict[str, str]:
        key_env = CODEX_KEY_ENV if self.transport == "websocket" else KEY_ENV
        return {"CODEX_HOME": str(launch.home / ".codex"), key_env: launch.session_key}

    def read_events(self, events: list[JsonObject]) -> tuple[str | None, int | None]:
        tool_calls = 0
        final: str | None = None
        for ev in events:
            if ev.get("type") != "item.completed":
                continue
            item = ev.get("item") or {}
            kind = item.get("type") or item.get("item_type")
            if kind in ("command_execution", "mcp_tool_call", "file_change"):
                tool_calls += 1
            elif kind in ("agent_message", "assistant_message"):
                text = item.get("text")
                final = text if isinstance(text, str) else final
        return final, tool_calls
