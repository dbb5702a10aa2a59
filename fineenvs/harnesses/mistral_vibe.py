"""Mistral Vibe (``mistral-vibe``, PyPI, Python >= 3.12): OpenAI Chat through a generic provider.

3.0.2, not the newest 3.0.3: 3.0.3 pins ``certifi==2026.10.19``, which PyPI does not serve (only
``2026.10.19.post1``), so it cannot be installed; 3.0.0 needs Python 3.14.
"""

from __future__ import annotations

import json
from pathlib import Path

from fineenvs.harnesses.base import OPENAI_CHAT, Harness, Launch, Outputs, read_text, with_v1

KEY_ENV = "FINEENVS_SESSION_KEY"
ALIAS = "fineenvs"


def _q(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


class MistralVibe(Harness):
    name = "mistral_vibe"
    package = "mistral-vibe"
    registry = "pypi"
    version = "3.0.2"
    binary = "vibe"
    api_formats = (OPENAI_CHAT,)
    default_format = OPENAI_CHAT
    python_version = "3.12"
    honours_step_limit = True  # --max-turns (headless)

    def write_config(self, launch: Launch) -> None:
        self.check_format(launch.api_format)
        lines = [
            f"active_model = {_q(ALIAS)}",
            "enable_telemetry = false",
            "enable_update_checks = false",
            "enable_auto_update = false",
            "",
            "[[providers]]",
            f"name = {_q(ALIAS)}",
            f"api_base = {_q(with_v1(launch.base_url))}",
            f"api_key_env_var = {_q(KEY_ENV)}",
            'api_style = "openai"',
            'backend = "generic"',
            "",
            "[[models]]",
            f"name = {_q(launch.model)}",
            f"provider = {_q(ALIAS)}",
            f"alias = {_q(ALIAS)}",
            "max_context_length = 200000",
            "",
        ]
        path = launch.home / ".vibe" / "config.toml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines))

    def command(self, launch: Launch) -> list[str]:
        cmd = [
            str(self.binary_path),
            "-p",
            launch.task_prompt,
            "--output",
            "json",
            "--auto-approve",
            "--trust",
            "--workdir",
            str(launch.workdir),
            "--output-dir",
            str(launch.home / "vibe-output"),
        ]
        if launch.step_limit is not None:
            cmd += ["--max-turns", str(launch.step_limit)]
        return cmd

    def env(self, launch: Launch) -> dict[str, str]:
        env = self.base_env(launch.home)
        env.update({"VIBE_HOME": str(launch.home / ".vibe"), KEY_ENV: launch.session_key})
        return env

    def parse_outputs(self, attempt_dir: Path) -> Outputs:
        text = read_text(attempt_dir / "stdout.txt")
        start = text.find("[")
        try:
            messages = json.loads(text[start:]) if start >= 0 else None
        except ValueError:
            messages = None
        if not isinstance(messages, list):
            return Outputs(
                final_text=text.strip() or None, native_tool_calls=None, detail="no json transcript"
            )
        # Transcript entries: `message` (user/assistant, content = text parts) and `effect`
        # (one per tool execution).
        tool_calls = 0
        final: str | None = None
        for entry in messages:
            if not isinstance(entry, dict):
                continue
            if entry.get("type") == "effect":
                tool_calls += 1
            elif entry.get("type") == "message" and entry.get("role") == "assistant":
                parts = entry.get("content") or []
                text = "".join(
                    p.get("text", "") for p in parts if isinstance(p, dict) and p.get("type") == "text"
                )
                if text.strip():
                    final = text
        return Outputs(final_text=final, native_tool_calls=tool_calls, detail="--output json")
