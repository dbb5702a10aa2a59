"""gptme (``gptme``, PyPI): OpenAI Chat with native tool calls (``--tool-format tool``).

Stands in for OpenHands (``openhands-sdk``): every openhands-sdk release requires Python >= 3.12
and uses 3.12-only syntax, and this project's machines have Python 3.11 only (Debian bookworm;
no other interpreter installs from the reachable registries). gptme is a maintained terminal
coding agent from PyPI that drives a shell tool through real function calling.
"""

from __future__ import annotations

from pathlib import Path

from fineenvs.harnesses.base import Launch, Outputs, PypiHarness, with_v1
from fineenvs.harnesses.files import iter_json_lines, read_text, write_text
from fineenvs.jsonl import JsonObject

CONVERSATION = "fineenvs-attempt"
TOOLS = "shell,save,read,patch,append"
MAX_STEPS = ".config/gptme/max_steps"
HEADLESS_FLAGS = ("--non-interactive", "--no-confirm", "--tool-format", "tool")
CONVERSATION_FLAGS = ("--name", CONVERSATION, "--context", "files")


class Gptme(PypiHarness):
    name = "gptme"
    honours_step_limit = True  # GPTME_MAX_STEPS

    def config_files(self, launch: Launch, fmt: str) -> dict[str, JsonObject]:
        # The base URL and key go through the [env] table of gptme's own config file, which
        # gptme reads before the process environment.
        env = {
            "OPENAI_BASE_URL": with_v1(launch.base_url),
            "OPENAI_API_KEY": launch.session_key,
            "MODEL": f"local/{launch.model}",
            "TOOL_FORMAT": "tool",
        }
        config = {"user": {"name": "fineenvs"}, "prompt": {"about_user": ""}, "env": env}
        return {".config/gptme/config.toml": config}

    def write_config(self, launch: Launch) -> None:
        super().write_config(launch)
        if launch.step_limit is not None:
            write_text(launch.home / MAX_STEPS, str(launch.step_limit))

    def arguments(self, launch: Launch) -> list[str]:
        agent = ["-m", f"local/{launch.model}", "-t", TOOLS]
        return [*HEADLESS_FLAGS, *agent, "-w", str(launch.workdir), *CONVERSATION_FLAGS, launch.task_prompt]

    def agent_env(self, launch: Launch) -> dict[str, str]:
        env = {
            "GPTME_TELEMETRY_ENABLED": "false",
            "GPTME_CHECK_UPDATE": "false",
            "GPTME_LOGS_HOME": str(launch.home / "gptme-logs"),
            "GPTME_SHELL_TIMEOUT": "120",
        }
        limit = read_text(launch.home / MAX_STEPS).strip()
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
        for msg in iter_json_lines(read_text(convs[-1])):
            content = msg.get("content")
            # With --tool-format tool, gptme stores each call as an `@tool(id): {...}` block.
            if msg.get("role") == "assistant" and isinstance(content, str):
                tool_calls += content.count("\n@") + (1 if content.startswith("@") else 0)
                if content.strip() and "@" not in content:
                    final = content.strip()
        return Outputs(final_text=final, native_tool_calls=tool_calls, detail=str(convs[-1].name))
