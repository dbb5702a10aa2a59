"""OpenCode (``opencode-ai``): any of the four formats through an AI SDK provider block."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fineenvs.harnesses.base import (
    ANTHROPIC_MESSAGES,
    GEMINI,
    OPENAI_CHAT,
    OPENAI_RESPONSES,
    Harness,
    Outputs,
    iter_json_lines,
    read_text,
    strip_v1,
    with_v1,
)

# Never call the provider `openai`: opencode then routes to its own Responses client and dies
# ("Z.responses is not a function", published system §4.11).
PROVIDER = "fineenvs"
SDK_BY_FORMAT = {
    OPENAI_CHAT: "@ai-sdk/openai-compatible",
    OPENAI_RESPONSES: "@ai-sdk/openai",
    ANTHROPIC_MESSAGES: "@ai-sdk/anthropic",
    GEMINI: "@ai-sdk/google",
}


def _base_for(fmt: str, base_url: str) -> str:
    if fmt == GEMINI:
        return strip_v1(base_url) + "/v1beta"
    return with_v1(base_url)


class OpenCode(Harness):
    name = "opencode"
    package = "opencode-ai"
    registry = "npm"
    version = "1.18.33"
    binary = "opencode"
    api_formats = (OPENAI_CHAT, OPENAI_RESPONSES, ANTHROPIC_MESSAGES, GEMINI)
    default_format = OPENAI_CHAT

    def config(self, *, base_url: str, session_key: str, model: str, api_format: str) -> dict[str, Any]:
        fmt = self.check_format(api_format)
        return {
            "$schema": "https://opencode.ai/config.json",
            "model": f"{PROVIDER}/{model}",
            "small_model": f"{PROVIDER}/{model}",
            "autoupdate": False,
            "share": "disabled",
            # Training profile of the published system: no subagents, no questions, no web.
            "tools": {"task": False, "question": False, "webfetch": False, "websearch": False},
            "permission": {"bash": "allow", "edit": "allow", "webfetch": "deny"},
            "provider": {
                PROVIDER: {
                    "npm": SDK_BY_FORMAT[fmt],
                    "name": "fineenvs proxy",
                    "options": {
                        "baseURL": _base_for(fmt, base_url),
                        "apiKey": session_key,
                        "timeout": 600000,
                    },
                    "models": {
                        model: {
                            "name": model,
                            "tool_call": True,
                            "limit": {"context": 200000, "output": 8192},
                        }
                    },
                }
            },
        }

    def write_config(
        self,
        home: Path,
        workdir: Path,
        *,
        base_url: str,
        session_key: str,
        model: str,
        api_format: str,
        step_limit: int | None,
    ) -> None:
        cfg = self.config(base_url=base_url, session_key=session_key, model=model, api_format=api_format)
        path = home / ".config" / "opencode" / "opencode.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cfg, indent=2) + "\n")

    def command(
        self,
        task_prompt: str,
        *,
        home: Path,
        workdir: Path,
        model: str,
        api_format: str,
        step_limit: int | None = None,
    ) -> list[str]:
        # One quoted argument reaches the model with literal quotes around it; words do not.
        return [
            str(self.binary_path),
            "run",
            "--format",
            "json",
            "--model",
            f"{PROVIDER}/{model}",
            *task_prompt.split(),
        ]

    def env(
        self,
        *,
        home: Path,
        workdir: Path,
        base_url: str,
        session_key: str,
        model: str,
        api_format: str,
    ) -> dict[str, str]:
        env = self.base_env(home)
        env.update(
            {
                "OPENCODE_CONFIG": str(home / ".config" / "opencode" / "opencode.json"),
                "OPENCODE_DISABLE_AUTOUPDATE": "1",
                "OPENCODE_DISABLE_MODELS_FETCH": "1",
                "OPENCODE_DISABLE_SHARE": "1",
                "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
                "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
                "OPENCODE_DISABLE_CLAUDE_CODE": "1",
            }
        )
        return env

    def parse_outputs(self, attempt_dir: Path) -> Outputs:
        events = iter_json_lines(read_text(attempt_dir / "stdout.txt"))
        tool_calls = 0
        texts: list[str] = []
        for ev in events:
            kind = ev.get("type")
            part = ev.get("part") or {}
            if kind == "tool_use":
                tool_calls += 1
            elif kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
        return Outputs(
            final_text=texts[-1] if texts else None,
            native_tool_calls=tool_calls if events else None,
            detail="run --format json",
        )
