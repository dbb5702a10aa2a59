"""Qwen Code (``@qwen-code/qwen-code``): Chat, Messages or Gemini, chosen by ``--auth-type``.

A fork of Gemini CLI: the same settings file under ``~/.qwen`` and the same command line after
``--auth-type``; it prints Claude Code's stream-json events, as one JSON array at the end.
"""

from __future__ import annotations

from pathlib import Path

from fineenvs.api_formats import ApiFormat
from fineenvs.harnesses.base import Launch, Outputs, sdk_env, transcript_outputs
from fineenvs.harnesses.claude_code import read_stream_json
from fineenvs.harnesses.files import read_text
from fineenvs.harnesses.gemini_cli import GeminiCli, gemini_settings
from fineenvs.jsonl import JsonObject

AUTH_BY_FORMAT: dict[str, str] = {
    ApiFormat.openai_chat: "openai",
    ApiFormat.anthropic_messages: "anthropic",
    ApiFormat.gemini: "gemini",
}
MODEL_ENV: dict[str, str] = {
    ApiFormat.openai_chat: "OPENAI_MODEL",
    ApiFormat.anthropic_messages: "ANTHROPIC_MODEL",
}


class QwenCode(GeminiCli):
    name = "qwen_code"

    def config_files(self, launch: Launch, fmt: str) -> dict[str, JsonObject]:
        return {".qwen/settings.json": gemini_settings(AUTH_BY_FORMAT[fmt], launch.step_limit)}

    def arguments(self, launch: Launch) -> list[str]:
        fmt = self.check_format(launch.api_format)
        return ["--auth-type", AUTH_BY_FORMAT[fmt], *super().arguments(launch)]

    def agent_env(self, launch: Launch) -> dict[str, str]:
        fmt = self.check_format(launch.api_format)
        model = {MODEL_ENV[fmt]: launch.model} if fmt in MODEL_ENV else {}
        return {**sdk_env(launch, fmt), **model, "QWEN_CODE_NO_RELAUNCH": "true"}

    def parse_outputs(self, attempt_dir: Path) -> Outputs:
        return transcript_outputs(
            read_text(attempt_dir / "stdout.txt"),
            self.read_events,
            detail=self.output_detail,
            missing="no json events",
        )

    def read_events(self, events: list[JsonObject]) -> tuple[str | None, int]:
        final, tool_calls = read_stream_json(events)
        return final, tool_calls or 0
