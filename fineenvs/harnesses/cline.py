"""Cline CLI (``cline``, npm): OpenAI Chat through its ``openai-compatible`` provider.

Stands in for Mistral Vibe (``mistral-vibe``): every mistral-vibe release requires Python >= 3.12
(3.12-only syntax in its modules), and this project's machines have Python 3.11 only. Cline is a
widely used tool-calling coding agent whose CLI ships as a native binary inside npm packages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fineenvs.harnesses.base import (
    OPENAI_CHAT,
    Harness,
    Launch,
    Outputs,
    iter_json_lines,
    read_text,
    with_v1,
    write_json,
)

PROVIDER = "openai-compatible"


class Cline(Harness):
    name = "cline"
    package = "cline"
    registry = "npm"
    version = "3.0.65"
    binary = "cline"
    api_formats = (OPENAI_CHAT,)
    default_format = OPENAI_CHAT

    @staticmethod
    def data_dir(home: Path) -> Path:
        return home / ".cline" / "data"

    def write_config(self, launch: Launch) -> None:
        self.check_format(launch.api_format)
        # The file `cline auth -p openai -k KEY -m MODEL -b URL` writes.
        write_json(
            self.data_dir(launch.home) / "settings" / "providers.json",
            {
                "version": 1,
                "lastUsedProvider": PROVIDER,
                "modes": {},
                "providers": {
                    PROVIDER: {
                        "settings": {
                            "provider": PROVIDER,
                            "apiKey": launch.session_key,
                            "model": launch.model,
                            "baseUrl": with_v1(launch.base_url),
                        },
                        # Without updatedAt the entry fails cline's schema and it falls back to
                        # its own hosted provider.
                        "updatedAt": "2026-01-01T00:00:00.000Z",
                        "tokenSource": "manual",
                    }
                },
            },
        )

    def command(self, launch: Launch) -> list[str]:
        # No -P/-m: passing the provider on the command line drops the baseUrl of providers.json
        # (cline then connects to its default endpoint); lastUsedProvider selects it instead.
        return [
            str(self.binary_path),
            "--json",
            "--auto-approve",
            "true",
            "-c",
            str(launch.workdir),
            "--compaction",
            "off",
            launch.task_prompt,
        ]

    def env(self, launch: Launch) -> dict[str, str]:
        env = self.base_env(launch.home)
        # No CLINE_DIR/CLINE_DATA_DIR/--data-dir: with any of them cline ignores providers.json and
        # falls back to its hosted provider. The fresh HOME isolates ~/.cline instead.
        return env

    def parse_outputs(self, attempt_dir: Path) -> Outputs:
        events = iter_json_lines(read_text(attempt_dir / "stdout.txt"))
        tool_calls = 0
        final: str | None = None
        for ev in events:
            raw = ev.get("event")
            inner: dict[str, Any] = raw if isinstance(raw, dict) else {}
            if ev.get("type") == "agent_event" and inner.get("type") == "iteration_end":
                count = inner.get("toolCallCount")
                tool_calls += count if isinstance(count, int) else 0
            elif ev.get("type") == "run_result" and isinstance(ev.get("text"), str):
                final = ev["text"]
        return Outputs(
            final_text=final, native_tool_calls=tool_calls if events else None, detail="--json events"
        )
