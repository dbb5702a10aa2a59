"""Mistral Vibe (``mistral-vibe``, PyPI, Python >= 3.12): OpenAI Chat through a generic provider.

3.0.2, not the newest 3.0.3: 3.0.3 pins ``certifi==2026.10.19``, which PyPI does not serve (only
``2026.10.19.post1``), so it cannot be installed; 3.0.0 needs Python 3.14.
"""

from __future__ import annotations

from pathlib import Path

from fineenvs.harnesses.base import Launch, Outputs, PypiHarness, transcript_outputs, with_v1
from fineenvs.harnesses.files import joined_text, read_text
from fineenvs.jsonl import JsonObject

KEY_ENV = "FINEENVS_SESSION_KEY"
ALIAS = "fineenvs"
HEADLESS_FLAGS = ("--output", "json", "--auto-approve", "--trust")


class MistralVibe(PypiHarness):
    name = "mistral_vibe"
    python_version = "3.12"
    honours_step_limit = True  # --max-turns (headless)

    def config_files(self, launch: Launch, fmt: str) -> dict[str, JsonObject]:
        provider = {
            "name": ALIAS,
            "api_base": with_v1(launch.base_url),
            "api_key_env_var": KEY_ENV,
            "api_style": "openai",
            "backend": "generic",
        }
        model = {"name": launch.model, "provider": ALIAS, "alias": ALIAS, "max_context_length": 200000}
        config = {
            "active_model": ALIAS,
            "enable_telemetry": False,
            "enable_update_checks": False,
            "enable_auto_update": False,
            "providers": [provider],
            "models": [model],
        }
        return {".vibe/config.toml": config}

    def arguments(self, launch: Launch) -> list[str]:
        dirs = ["--workdir", str(launch.workdir), "--output-dir", str(launch.home / "vibe-output")]
        return ["-p", launch.task_prompt, *HEADLESS_FLAGS, *dirs, *launch.step_args("--max-turns")]

    def agent_env(self, launch: Launch) -> dict[str, str]:
        return {"VIBE_HOME": str(launch.home / ".vibe"), KEY_ENV: launch.session_key}

    def parse_outputs(self, attempt_dir: Path) -> Outputs:
        return transcript_outputs(
            read_text(attempt_dir / "stdout.txt"),
            _read_transcript,
            detail="--output json",
            missing="no json transcript",
        )


def _read_transcript(entries: list[JsonObject]) -> tuple[str | None, int]:
    """Transcript entries: `message` (user/assistant, content = text parts) and `effect` (one per
    tool execution)."""
    tool_calls = 0
    final: str | None = None
    for entry in entries:
        if entry.get("type") == "effect":
            tool_calls += 1
        elif entry.get("type") == "message" and entry.get("role") == "assistant":
            text = joined_text(entry.get("content"))
            if text.strip():
                final = text
    return final, tool_calls
