"""gptme (``gptme``, PyPI): OpenAI Chat with native tool calls (``--tool-format tool``).

Stands in for OpenHands (``openhands-sdk``): every openhands-sdk release requires Python >= 3.12
and uses 3.12-only syntax, and this project's machines have Python 3.11 only (Debian bookworm;
no other interpreter installs from the reachable registries). gptme is a maintained terminal
coding agent from PyPI that drives a shell tool through real function calling.
"""

from __future__ import annotations

import json
from pathlib import Path

from fineenvs.harnesses.base import OPENAI_CHAT, Harness, Launch, Outputs, read_text, with_v1

CONVERSATION = "fineenvs-attempt"
TOOLS = "shell,save,read,patch,append"


class Gptme(Harness):
    name = "gptme"
    package = "gptme"
    registry = "pypi"
    version = "0.35.1"
    binary = "gptme"
    api_formats = (OPENAI_CHAT,)
    default_format = OPENAI_CHAT
    honours_step_limit = True  # GPTME_MAX_STEPS

    def write_config(self, launch: Launch) -> None:
        self.check_format(launch.api_format)
        # The base URL and key go through the [env] table of gptme's own config file, which
        # gptme reads before the process environment.
        path = launch.home / ".config" / "gptme" / "config.toml"
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = [
            "[user]",
            'name = "fineenvs"',
            "",
            "[prompt]",
            'about_user = ""',
            "",
            "[env]",
            f"OPENAI_BASE_URL = {json.dumps(with_v1(launch.base_url))}",
            f"OPENAI_API_KEY = {json.dumps(launch.session_key)}",
            f"MODEL = {json.dumps('local/' + launch.model)}",
            'TOOL_FORMAT = "tool"',
            "",
        ]
        path.write_text("\n".join(lines))
        if launch.step_limit is not None:
            (launch.home / ".config" / "gptme" / "max_steps").write_text(str(launch.step_limit))

    def command(self, launch: Launch) -> list[str]:
        return [
            str(self.binary_path),
            "--non-interactive",
            "--no-confirm",
            "--tool-format",
            "tool",
            "-m",
            f"local/{launch.model}",
            "-t",
            TOOLS,
            "-w",
            str(launch.workdir),
            "--name",
            CONVERSATION,
            "--context",
            "files",
            launch.task_prompt,
        ]

    def env(self, launch: Launch) -> dict[str, str]:
        env = self.base_env(launch.home)
        env.update(
            {
                "GPTME_TELEMETRY_ENABLED": "false",
                "GPTME_CHECK_UPDATE": "false",
                "GPTME_LOGS_HOME": str(launch.home / "gptme-logs"),
                "GPTME_SHELL_TIMEOUT": "120",
            }
        )
        limit = read_text(launch.home / ".config" / "gptme" / "max_steps").strip()
        if limit.isdigit():
            env["GPTME_MAX_STEPS"] = limit
        return env

    def parse_outputs(self, attempt_dir: Path) -> Outputs:
        logs = attempt_dir / "home" / "gptme-logs"
        convs = sorted(logs.glob("*/conversation.jsonl")) if logs.is_dir() else []
        if not convs:
            return Outputs(
                final_text=None, native_tool_calls=None, detail=f"no conversation log under {logs}"
            )
        tool_calls = 0
        final: str | None = None
        for line in read_text(convs[-1]).splitlines():
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if not isinstance(msg, dict) or msg.get("role") != "assistant":
                continue
            content = msg.get("content")
            # With --tool-format tool, gptme stores each call as an `@tool(id): {...}` block.
            if isinstance(content, str):
                tool_calls += content.count("\n@") + (1 if content.startswith("@") else 0)
                if content.strip() and "@" not in content:
                    final = content.strip()
        return Outputs(final_text=final, native_tool_calls=tool_calls, detail=str(convs[-1].name))
