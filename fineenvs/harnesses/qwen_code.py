"""Qwen Code (``@qwen-code/qwen-code``): Chat, Messages or Gemini, chosen by ``--auth-type``."""

from __future__ import annotations

import json
from pathlib import Path

from fineenvs.harnesses.base import (
    ANTHROPIC_MESSAGES,
    GEMINI,
    OPENAI_CHAT,
    Harness,
    Launch,
    Outputs,
    read_text,
    strip_v1,
    with_v1,
    write_json,
)
from fineenvs.harnesses.gemini_cli import gemini_settings

AUTH_BY_FORMAT = {OPENAI_CHAT: "openai", ANTHROPIC_MESSAGES: "anthropic", GEMINI: "gemini"}


class QwenCode(Harness):
    name = "qwen_code"
    package = "@qwen-code/qwen-code"
    registry = "npm"
    version = "0.15.10"
    binary = "qwen"
    api_formats = (OPENAI_CHAT, ANTHROPIC_MESSAGES, GEMINI)
    default_format = OPENAI_CHAT
    honours_step_limit = True  # model.maxSessionTurns

    def write_config(self, launch: Launch) -> None:
        fmt = self.check_format(launch.api_format)
        write_json(
            launch.home / ".qwen" / "settings.json", gemini_settings(AUTH_BY_FORMAT[fmt], launch.step_limit)
        )

    def command(self, launch: Launch) -> list[str]:
        fmt = self.check_format(launch.api_format)
        return [
            str(self.binary_path),
            "--auth-type",
            AUTH_BY_FORMAT[fmt],
            "-m",
            launch.model,
            "-p",
            launch.task_prompt,
            "--yolo",
            "--output-format",
            "json",
        ]

    def env(self, launch: Launch) -> dict[str, str]:
        fmt = self.check_format(launch.api_format)
        env = self.base_env(launch.home)
        if fmt == OPENAI_CHAT:
            env.update(
                {
                    "OPENAI_API_KEY": launch.session_key,
                    "OPENAI_BASE_URL": with_v1(launch.base_url),
                    "OPENAI_MODEL": launch.model,
                }
            )
        elif fmt == ANTHROPIC_MESSAGES:
            env.update(
                {
                    "ANTHROPIC_API_KEY": launch.session_key,
                    "ANTHROPIC_BASE_URL": strip_v1(launch.base_url),
                    "ANTHROPIC_MODEL": launch.model,
                }
            )
        else:
            env.update(
                {"GEMINI_API_KEY": launch.session_key, "GOOGLE_GEMINI_BASE_URL": strip_v1(launch.base_url)}
            )
        env["QWEN_CODE_NO_RELAUNCH"] = "true"
        return env

    def parse_outputs(self, attempt_dir: Path) -> Outputs:
        text = read_text(attempt_dir / "stdout.txt")
        start = text.find("[")
        try:
            events = json.loads(text[start:]) if start >= 0 else None
        except ValueError:
            events = None
        if not isinstance(events, list):
            return Outputs(final_text=text.strip() or None, native_tool_calls=None, detail="no json events")
        tool_calls = 0
        final: str | None = None
        for ev in events:
            if not isinstance(ev, dict):
                continue
            if ev.get("type") == "assistant":
                content = (ev.get("message") or {}).get("content") or []
                tool_calls += sum(1 for b in content if isinstance(b, dict) and b.get("type") == "tool_use")
            elif ev.get("type") == "result" and isinstance(ev.get("result"), str):
                final = ev["result"]
        return Outputs(final_text=final, native_tool_calls=tool_calls, detail="--output-format json")
