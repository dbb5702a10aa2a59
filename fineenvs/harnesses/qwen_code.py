"""Qwen Code (``@qwen-code/qwen-code``): Chat, Messages or Gemini, chosen by ``--auth-type``."""

from __future__ import annotations

import json
from pathlib import Path

from fineenvs.harnesses.base import (
    ANTHROPIC_MESSAGES,
    GEMINI,
    OPENAI_CHAT,
    Harness,
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
        fmt = self.check_format(api_format)
        write_json(home / ".qwen" / "settings.json", gemini_settings(AUTH_BY_FORMAT[fmt], step_limit))

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
        fmt = self.check_format(api_format)
        return [
            str(self.binary_path),
            "--auth-type",
            AUTH_BY_FORMAT[fmt],
            "-m",
            model,
            "-p",
            task_prompt,
            "--yolo",
            "--output-format",
            "json",
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
        fmt = self.check_format(api_format)
        env = self.base_env(home)
        if fmt == OPENAI_CHAT:
            env.update(
                {"OPENAI_API_KEY": session_key, "OPENAI_BASE_URL": with_v1(base_url), "OPENAI_MODEL": model}
            )
        elif fmt == ANTHROPIC_MESSAGES:
            env.update(
                {
                    "ANTHROPIC_API_KEY": session_key,
                    "ANTHROPIC_BASE_URL": strip_v1(base_url),
                    "ANTHROPIC_MODEL": model,
                }
            )
        else:
            env.update({"GEMINI_API_KEY": session_key, "GOOGLE_GEMINI_BASE_URL": strip_v1(base_url)})
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
