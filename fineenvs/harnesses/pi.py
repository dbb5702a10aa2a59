"""Pi (``@mariozechner/pi-coding-agent``): any of the four formats via ``~/.pi/agent/models.json``."""

from __future__ import annotations

import json
from pathlib import Path

from fineenvs.harnesses.base import (
    ANTHROPIC_MESSAGES,
    GEMINI,
    OPENAI_CHAT,
    OPENAI_RESPONSES,
    Harness,
    Launch,
    Outputs,
    read_text,
    strip_v1,
    with_v1,
    write_json,
)

PROVIDER = "fineenvs"
KEY_ENV = "FINEENVS_SESSION_KEY"
API_BY_FORMAT = {
    OPENAI_CHAT: "openai-completions",
    OPENAI_RESPONSES: "openai-responses",
    ANTHROPIC_MESSAGES: "anthropic-messages",
    GEMINI: "google-generative-ai",
}


def _base_for(fmt: str, base_url: str) -> str:
    if fmt == ANTHROPIC_MESSAGES:
        return strip_v1(base_url)
    if fmt == GEMINI:
        return strip_v1(base_url) + "/v1beta"
    return with_v1(base_url)


class Pi(Harness):
    name = "pi"
    package = "@mariozechner/pi-coding-agent"
    registry = "npm"
    version = "0.73.1"
    binary = "pi"
    api_formats = (OPENAI_CHAT, OPENAI_RESPONSES, ANTHROPIC_MESSAGES, GEMINI)
    default_format = OPENAI_CHAT

    def write_config(self, launch: Launch) -> None:
        fmt = self.check_format(launch.api_format)
        # apiKey names an env var, so the key itself stays out of the file.
        write_json(
            launch.home / ".pi" / "agent" / "models.json",
            {
                "providers": {
                    PROVIDER: {
                        "baseUrl": _base_for(fmt, launch.base_url),
                        "api": API_BY_FORMAT[fmt],
                        "apiKey": KEY_ENV,
                        "models": [{"id": launch.model, "contextWindow": 200000, "maxTokens": 8192}],
                    }
                }
            },
        )

    def command(self, launch: Launch) -> list[str]:
        return [
            str(self.binary_path),
            "-p",
            launch.task_prompt,
            "--model",
            f"{PROVIDER}/{launch.model}",
            "--mode",
            "json",
        ]

    def env(self, launch: Launch) -> dict[str, str]:
        env = self.base_env(launch.home)
        env.update({KEY_ENV: launch.session_key, "PI_OFFLINE": "1", "PI_SKIP_VERSION_CHECK": "1"})
        return env

    def parse_outputs(self, attempt_dir: Path) -> Outputs:
        text = read_text(attempt_dir / "stdout.txt")
        tool_calls = 0
        final: str | None = None
        saw = False
        for line in text.splitlines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if not isinstance(ev, dict):
                continue
            if ev.get("type") == "message_end":
                msg = ev.get("message") or {}
                if msg.get("role") != "assistant":
                    continue
                saw = True
                parts = msg.get("content") or []
                tool_calls += sum(1 for p in parts if isinstance(p, dict) and p.get("type") == "toolCall")
                texts = [p.get("text", "") for p in parts if isinstance(p, dict) and p.get("type") == "text"]
                if any(texts):
                    final = "".join(texts)
        return Outputs(final_text=final, native_tool_calls=tool_calls if saw else None, detail="--mode json")
