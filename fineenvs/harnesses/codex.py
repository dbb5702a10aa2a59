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

import json
from pathlib import Path

from fineenvs.harnesses.base import (
    OPENAI_RESPONSES,
    Harness,
    HarnessConfigError,
    Launch,
    Outputs,
    iter_json_lines,
    read_text,
    with_v1,
)

KEY_ENV = "FINEENVS_SESSION_KEY"
# codex exec's own variable for the built-in provider's API key.
CODEX_KEY_ENV = "CODEX_API_KEY"
TRANSPORTS = ("websocket", "http")


def _toml_str(value: str) -> str:
    # JSON string escaping is valid TOML basic-string escaping for the characters we emit.
    return json.dumps(value)


class Codex(Harness):
    name = "codex"
    package = "@openai/codex"
    registry = "npm"
    version = "0.171.0"
    binary = "codex"
    api_formats = (OPENAI_RESPONSES,)
    default_format = OPENAI_RESPONSES

    def __init__(self, transport: str = "websocket") -> None:
        if transport not in TRANSPORTS:
            raise HarnessConfigError(
                f"codex transport {transport!r} is unknown: use one of {', '.join(TRANSPORTS)}"
            )
        self.transport = transport

    def write_config(self, launch: Launch) -> None:
        self.check_format(launch.api_format)
        common = [
            f"model = {_toml_str(launch.model)}",
            "check_for_update_on_startup = false",
            'approval_policy = "never"',
            'sandbox_mode = "danger-full-access"',
        ]
        tail = [
            "",
            "[analytics]",
            "enabled = false",
            "",
            "[features]",
            "plugins = false",
            "",
            "[history]",
            'persistence = "none"',
            "",
        ]
        if self.transport == "websocket":
            # The built-in provider, only its base URL moved: Codex's default transport.
            provider = [f"openai_base_url = {_toml_str(with_v1(launch.base_url))}"]
        else:
            # A custom provider (not the built-in `openai`) never tries the WebSocket.
            provider = [
                'model_provider = "fineenvs"',
                "",
                "[model_providers.fineenvs]",
                'name = "fineenvs"',
                f"base_url = {_toml_str(with_v1(launch.base_url))}",
                f"env_key = {_toml_str(KEY_ENV)}",
                'wire_api = "responses"',
                "request_max_retries = 1",
                "stream_max_retries = 1",
            ]
        text = "\n".join([*common, *provider, *tail])
        path = launch.home / ".codex" / "config.toml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def command(self, launch: Launch) -> list[str]:
        return [
            str(self.binary_path),
            "exec",
            "--json",
            "--dangerously-bypass-approvals-and-sandbox",
            "--skip-git-repo-check",
            "-C",
            str(launch.workdir),
            launch.task_prompt,
        ]

    def env(self, launch: Launch) -> dict[str, str]:
        env = self.base_env(launch.home)
        key_env = CODEX_KEY_ENV if self.transport == "websocket" else KEY_ENV
        env.update({"CODEX_HOME": str(launch.home / ".codex"), key_env: launch.session_key})
        return env

    def parse_outputs(self, attempt_dir: Path) -> Outputs:
        events = iter_json_lines(read_text(attempt_dir / "stdout.txt"))
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
        return Outputs(
            final_text=final, native_tool_calls=tool_calls if events else None, detail="exec --json"
        )
