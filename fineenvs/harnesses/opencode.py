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
    Launch,
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
    """OpenCode, and the base of its forks (Kilo CLI): what a fork names differently is a class
    attribute or a hook (``extra_config``, ``run_flags``, ``workdir_flags``, ``extra_env``)."""

    name = "opencode"
    package = "opencode-ai"
    registry = "npm"
    version = "1.18.33"
    binary = "opencode"
    api_formats = (OPENAI_CHAT, OPENAI_RESPONSES, ANTHROPIC_MESSAGES, GEMINI)
    default_format = OPENAI_CHAT
    schema_url = "https://opencode.ai/config.json"
    config_parts: tuple[str, ...] = (".config", "opencode", "opencode.json")
    env_prefix = "OPENCODE"
    run_flags: tuple[str, ...] = ()

    def config_path(self, home: Path) -> Path:
        return home.joinpath(*self.config_parts)

    def config(self, launch: Launch) -> dict[str, Any]:
        fmt = self.check_format(launch.api_format)
        model = launch.model
        return {
            "$schema": self.schema_url,
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
                        "baseURL": _base_for(fmt, launch.base_url),
                        "apiKey": launch.session_key,
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
            **self.extra_config(launch),
        }

    def extra_config(self, launch: Launch) -> dict[str, Any]:
        """Keys a fork adds to the config."""
        return {}

    def write_config(self, launch: Launch) -> None:
        path = self.config_path(launch.home)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.config(launch), indent=2) + "\n")

    def command(self, launch: Launch) -> list[str]:
        # One quoted argument reaches the model with literal quotes around it; words do not.
        return [
            str(self.binary_path),
            "run",
            "--format",
            "json",
            *self.run_flags,
            "--model",
            f"{PROVIDER}/{launch.model}",
            *self.workdir_flags(launch),
            *launch.task_prompt.split(),
        ]

    def workdir_flags(self, launch: Launch) -> list[str]:
        """OpenCode runs in its working directory; a fork may name it."""
        return []

    def env(self, launch: Launch) -> dict[str, str]:
        p = self.env_prefix
        env = self.base_env(launch.home)
        env[f"{p}_CONFIG"] = str(self.config_path(launch.home))
        for switch in (
            "AUTOUPDATE",
            "MODELS_FETCH",
            "SHARE",
            "LSP_DOWNLOAD",
            "DEFAULT_PLUGINS",
            "CLAUDE_CODE",
        ):
            env[f"{p}_DISABLE_{switch}"] = "1"
        env.update(self.extra_env())
        return env

    def extra_env(self) -> dict[str, str]:
        """Switches a fork adds."""
        return {}

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
