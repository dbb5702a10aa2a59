"""Gemini CLI (``@google/gemini-cli``): Gemini ``streamGenerateContent`` with an API-key auth type."""

from __future__ import annotations

from fineenvs.api_formats import ApiFormat
from fineenvs.harnesses.base import Launch, NpmHarness, sdk_env
from fineenvs.harnesses.files import json_from
from fineenvs.jsonl import JsonObject


def gemini_settings(auth_type: str, step_limit: int | None) -> JsonObject:
    """settings.json shared by gemini-cli and its fork qwen-code: no stats, no updates, no nags."""
    settings: JsonObject = {
        "security": {"auth": {"selectedType": auth_type}, "folderTrust": {"enabled": False}},
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
        "general": {"disableAutoUpdate": True, "disableUpdateNag": True, "checkpointing": {"enabled": False}},
        "ui": {"hideTips": True, "hideBanner": True},
    }
    if step_limit is not None:
        settings["model"] = {"maxSessionTurns": step_limit}
    return settings


HEADLESS_FLAGS = ("--yolo", "--output-format", "json")


class GeminiCli(NpmHarness):
    """Gemini CLI, and the base of its fork Qwen Code, which keeps its command line."""

    name = "gemini_cli"
    honours_step_limit = True  # model.maxSessionTurns
    output_detail = "--output-format json"

    def config_files(self, launch: Launch, fmt: str) -> dict[str, JsonObject]:
        return {".gemini/settings.json": gemini_settings("gemini-api-key", launch.step_limit)}

    def arguments(self, launch: Launch) -> list[str]:
        # -m pins the model: without it a router side call (wanting JSON) comes first.
        return ["-m", launch.model, "-p", launch.task_prompt, *HEADLESS_FLAGS]

    def agent_env(self, launch: Launch) -> dict[str, str]:
        return {
            **sdk_env(launch, ApiFormat.gemini),
            "GEMINI_CLI_TRUST_WORKSPACE": "true",
            "GEMINI_CLI_NO_RELAUNCH": "true",
        }

    def stdout_events(self, stdout: str) -> list[JsonObject]:
        """The one result object ``--output-format json`` prints, where stdout holds it."""
        result = json_from(stdout, "{")
        return [result] if isinstance(result, dict) else []

    def read_events(self, events: list[JsonObject]) -> tuple[str | None, int | None]:
        result = events[0] if events else {}
        response = result.get("response")
        tools = ((result.get("stats") or {}).get("tools") or {}).get("totalCalls")
        return (response if isinstance(response, str) else None), (tools if isinstance(tools, int) else None)
