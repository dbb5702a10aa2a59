"""Cline CLI (``cline``, npm): OpenAI Chat through its ``openai-compatible`` provider.

Stands in for Mistral Vibe (``mistral-vibe``): every mistral-vibe release requires Python >= 3.12
(3.12-only syntax in its modules), and this project's machines have Python 3.11 only. Cline is a
widely used tool-calling coding agent whose CLI ships as a native binary inside npm packages.
"""

from __future__ import annotations

from pathlib import Path

from fineenvs.harnesses.base import (
    OPENAI_CHAT,
    Harness,
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
        self.check_format(api_format)
        # The file `cline auth -p openai -k KEY -m MODEL -b URL` writes.
        write_json(
            self.data_dir(home) / "settings" / "providers.json",
            {
                "version": 1,
                "lastUsedProvider": PROVIDER,
                "modes": {},
                "providers": {
                    PROVIDER: {
                        "settings": {
                            "provider": PROVIDER,
                            "apiKey": session_key,
                            "model": model,
                            "baseUrl": with_v1(base_url),
                        },
                        "tokenSource": "manual",
                    }
                },
            },
        )

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
        return [
            str(self.binary_path),
            "--json",
            "--auto-approve",
            "true",
            "-P",
            PROVIDER,
            "-m",
            model,
            "-c",
            str(workdir),
            "--data-dir",
            str(self.data_dir(home)),
            "--compaction",
            "off",
            task_prompt,
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
        env = self.base_env(home)
        env.update({"CLINE_DIR": str(home / ".cline"), "CLINE_DATA_DIR": str(self.data_dir(home))})
        return env

    def parse_outputs(self, attempt_dir: Path) -> Outputs:
        events = iter_json_lines(read_text(attempt_dir / "stdout.txt"))
        tool_calls = 0
        final: str | None = None
        for ev in events:
            kind = str(ev.get("type") or ev.get("say") or ev.get("ask") or "")
            if kind in ("tool", "command", "tool_call", "tool_use"):
                tool_calls += 1
            text = ev.get("text")
            if (
                kind in ("text", "completion_result", "assistant", "result")
                and isinstance(text, str)
                and text.strip()
            ):
                final = text
        return Outputs(final_text=final, native_tool_calls=tool_calls if events else None, detail="--json")
