"""Kilo CLI (``@kilocode/cli``): any of the four formats through an AI SDK provider block.

Kilo CLI is a fork of OpenCode, so its configuration is OpenCode's (``provider.<id>.npm`` picks
the bundled AI SDK client, ``options.baseURL`` the endpoint) under Kilo's own names:
``KILO_CONFIG`` for the config file, ``KILO_*`` switches. Unlike OpenCode it honours a step
limit: ``agent.<name>.steps`` ("maximum number of agentic iterations before forcing text-only
response") on its default agent, ``code``.

Pinned at 7.7.7: the newest release whose platform package (``@kilocode/cli-linux-x64``, which
holds the native binary) is published at the same version; 7.8.1's is not.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fineenvs.harnesses.base import (
    ANTHROPIC_MESSAGES,
    GEMINI,
    OPENAI_CHAT,
    OPENAI_RESPONSES,
    Harness,
    Outputs,
    iter_json_lines,
    read_text,
    strip_v1,
    with_v1,
)

# Not `openai` or `kilo`: those names select Kilo's own built-in provider definitions.
PROVIDER = "fineenvs"
AGENT = "code"
SDK_BY_FORMAT = {
    OPENAI_CHAT: "@ai-sdk/openai-compatible",
    OPENAI_RESPONSES: "@ai-sdk/openai",
    ANTHROPIC_MESSAGES: "@ai-sdk/anthropic",
    GEMINI: "@ai-sdk/google",
}


def _base_for(fmt: str, base_url: str) -> str:
    if fmt == GEMINI:
        return strip_v1(base_url) + "/v1beta"
    return with_v1(base_url)


class Kilo(Harness):
    name = "kilo"
    package = "@kilocode/cli"
    registry = "npm"
    version = "7.7.7"
    binary = "kilo"
    api_formats = (OPENAI_CHAT, OPENAI_RESPONSES, ANTHROPIC_MESSAGES, GEMINI)
    default_format = OPENAI_CHAT
    honours_step_limit = True  # agent.code.steps

    @staticmethod
    def config_path(home: Path) -> Path:
        return home / ".config" / "kilo" / "kilo.json"

    def config(
        self, *, base_url: str, session_key: str, model: str, api_format: str, step_limit: int | None
    ) -> dict[str, Any]:
        fmt = self.check_format(api_format)
        agent: dict[str, Any] = {"steps": step_limit} if step_limit is not None else {}
        return {
            "$schema": "https://app.kilo.ai/config.json",
            "model": f"{PROVIDER}/{model}",
            "small_model": f"{PROVIDER}/{model}",
            "default_agent": AGENT,
            "autoupdate": False,
            "share": "disabled",
            # Only ours: the built-in `kilo` gateway provider otherwise fetches its model list.
            "enabled_providers": [PROVIDER],
            # As for OpenCode: no subagents, no questions, no web.
            "tools": {"task": False, "question": False, "webfetch": False, "websearch": False},
            "permission": {"bash": "allow", "edit": "allow", "webfetch": "deny"},
            "agent": {AGENT: agent},
            "provider": {
                PROVIDER: {
                    "npm": SDK_BY_FORMAT[fmt],
                    "name": "fineenvs proxy",
                    "options": {
                        "baseURL": _base_for(fmt, base_url),
                        "apiKey": session_key,
                        "timeout": 600000,
                    },
                    "models": {
                        model: {
                            "name": model,
                            "tool_call": True,
                            "limit": {"context": 200000, "output": 8192},
                        }
                    },
                }
            },
        }

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
        cfg = self.config(
            base_url=base_url,
            session_key=session_key,
            model=model,
            api_format=api_format,
            step_limit=step_limit,
        )
        path = self.config_path(home)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cfg, indent=2) + "\n")

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
            "run",
            "--format",
            "json",
            "--auto",
            "--pure",
            "--model",
            f"{PROVIDER}/{model}",
            "--dir",
            str(workdir),
            *task_prompt.split(),
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
        env.update(
            {
                "KILO_CONFIG": str(self.config_path(home)),
                "KILO_TELEMETRY_LEVEL": "off",
                "KILO_DISABLE_AUTOUPDATE": "1",
                "KILO_DISABLE_MODELS_FETCH": "1",
                "KILO_DISABLE_SHARE": "1",
                "KILO_DISABLE_LSP_DOWNLOAD": "1",
                "KILO_DISABLE_DEFAULT_PLUGINS": "1",
                "KILO_DISABLE_CLAUDE_CODE": "1",
                "KILO_DISABLE_SESSION_INGEST": "1",
                "KILO_DISABLE_CODEBASE_INDEXING": "1",
                "KILO_DISABLE_EXTERNAL_SKILLS": "1",
                "KILO_DISABLE_PROJECT_CONFIG": "1",
                "KILO_NO_DAEMON": "1",
            }
        )
        return env

    def parse_outputs(self, attempt_dir: Path) -> Outputs:
        events = iter_json_lines(read_text(attempt_dir / "stdout.txt"))
        tool_calls = 0
        texts: list[str] = []
        for ev in events:
            kind = ev.get("type")
            part = ev.get("part") or {}
            if kind == "tool_use":
                tool_calls += 1
            elif kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
        return Outputs(
            final_text=texts[-1] if texts else None,
            native_tool_calls=tool_calls if events else None,
            detail="run --format json",
        )
