"""Hermes Agent (``hermes-agent``, PyPI): Chat, Messages or Responses through a custom provider."""

from __future__ import annotations

import json
import sqlite3
from contextlib import closing
from pathlib import Path

from fineenvs.api_formats import ApiFormat
from fineenvs.harnesses.base import Launch, Outputs, PypiHarness, sdk_base_url
from fineenvs.harnesses.files import read_text
from fineenvs.jsonl import JsonObject

MODE_BY_FORMAT: dict[str, str] = {
    ApiFormat.openai_chat: "chat_completions",
    ApiFormat.anthropic_messages: "anthropic_messages",
    ApiFormat.openai_responses: "codex_responses",
}
CONTEXT_LENGTH = 200000
HEADLESS_FLAGS = ("--yolo",)


class Hermes(PypiHarness):
    name = "hermes"
    # The newest anthropic SDK breaks hermes' Messages mode (httpx2 timeout error).
    extra_requirements = ("anthropic==0.87.0",)
    honours_step_limit = True  # agent.max_turns

    def config_files(self, launch: Launch, fmt: str) -> dict[str, JsonObject]:
        # `provider: custom:NAME` (not plain `custom`) is what makes api_mode take effect;
        # context_length stops the model-metadata probes and the openrouter lookup.
        provider = {
            "name": "fineenvs",
            "base_url": sdk_base_url(fmt, launch.base_url),
            "api_key": launch.session_key,
            "api_mode": MODE_BY_FORMAT[fmt],
            "model": launch.model,
            "context_length": CONTEXT_LENGTH,
        }
        config = {
            "model": {
                "default": launch.model,
                "provider": "custom:fineenvs",
                "context_length": CONTEXT_LENGTH,
            },
            "custom_providers": [provider],
            "agent": {"max_turns": launch.step_limit or 90},
            "telemetry": {"enabled": False},
        }
        return {".hermes/config.yaml": config}

    def arguments(self, launch: Launch) -> list[str]:
        return ["-z", launch.task_prompt, *HEADLESS_FLAGS]

    def agent_env(self, launch: Launch) -> dict[str, str]:
        return {
            "HERMES_HOME": str(launch.home / ".hermes"),
            "HERMES_DISABLE_LAZY_INSTALLS": "1",
            "HERMES_DISABLE_UPDATE_CHECK": "1",
        }

    def parse_outputs(self, attempt_dir: Path) -> Outputs:
        final = read_text(attempt_dir / "stdout.txt").strip() or None
        db = attempt_dir / "home" / ".hermes" / "state.db"
        if not db.is_file():
            return Outputs(final_text=final, native_tool_calls=None, detail=f"no {db}")
        # Hermes keeps its transcript in SQLite: one row per message, tool_calls as a JSON list.
        tool_calls = 0
        try:
            with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
                rows = conn.execute("SELECT tool_calls FROM messages WHERE role = 'assistant'").fetchall()
        except sqlite3.Error as exc:
            return Outputs(final_text=final, native_tool_calls=None, detail=f"state.db unreadable: {exc}")
        for (raw,) in rows:
            try:
                calls = json.loads(raw) if raw else []
            except ValueError:
                continue
            tool_calls += len(calls) if isinstance(calls, list) else 0
        return Outputs(final_text=final, native_tool_calls=tool_calls, detail="stdout + ~/.hermes/state.db")
