"""Gemini CLI (``@google/gemini-cli``): Gemini ``streamGenerateContent`` with an API-key auth type."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fineenvs.harnesses.base import GEMINI, Harness, Launch, Outputs, read_text, strip_v1, write_json


def gemini_settings(auth_type: str, step_limit: int | None) -> dict[str, Any]:
    """settings.json shared by gemini-cli and its fork qwen-code: no stats, no updates, no nags."""
    settings: dict[str, Any] = {
        "security": {"auth": {"selectedType": auth_type}, "folderTrust": {"enabled": False}},
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
        "general": {"disableAutoUpdate": True, "disableUpdateNag": True, "checkpointing": {"enabled": False}},
        "ui": {"hideTips": True, "hideBanner": True},
    }
    if step_limit is not None:
        settings["model"] = {"maxSessionTurns": step_limit}
    return settings


def parse_json_result(text: str) -> tuple[str | None, int | None]:
    """(response, tool calls) from a ``--output-format json`` result object, if stdout holds one."""
    start = text.find("{")
    if start < 0:
        return None, None
    try:
        obj = json.loads(text[start:])
    except ValueError:
        return None, None
    if not isinstance(obj, dict):
        return None, None
    response = obj.get("response")
    tools = ((obj.get("stats") or {}).get("tools") or {}).get("totalCalls")
    return (response if isinstance(response, str) else None), (tools if isinstance(tools, int) else None)


class GeminiCli(Harness):
    name = "gemini_cli"
    package = "@google/gemini-cli"
    registry = "npm"
    version = "0.61.0"
    binary = "gemini"
    api_formats = (GEMINI,)
    default_format = GEMINI
    honours_step_limit = True  # model.maxSessionTurns

    def write_config(self, launch: Launch) -> None:
        self.check_format(launch.api_format)
        write_json(
            launch.home / ".gemini" / "settings.json", gemini_settings("gemini-api-key", launch.step_limit)
        )

    def command(self, launch: Launch) -> list[str]:
        # -m pins the model: without it a router side call (wanting JSON) comes first.
        return [
            str(self.binary_path),
            "-m",
            launch.model,
            "-p",
            launch.task_prompt,
            "--yolo",
            "--output-format",
            "json",
        ]

    def env(self, launch: Launch) -> dict[str, str]:
        env = self.base_env(launch.home)
        env.update(
            {
                "GEMINI_API_KEY": launch.session_key,
                "GOOGLE_GEMINI_BASE_URL": strip_v1(launch.base_url),
                "GEMINI_CLI_TRUST_WORKSPACE": "true",
                "GEMINI_CLI_NO_RELAUNCH": "true",
            }
        )
        return env

    def parse_outputs(self, attempt_dir: Path) -> Outputs:
        final, tools = parse_json_result(read_text(attempt_dir / "stdout.txt"))
        return Outputs(final_text=final, native_tool_calls=tools, detail="--output-format json")
