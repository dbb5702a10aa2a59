"""OpenHands (``openhands-sdk`` + ``openhands-tools``, PyPI, Python >= 3.12): OpenAI Chat via litellm.

The SDK has no CLI of its own; :mod:`fineenvs.harnesses.openhands_driver` builds the standard
agent (terminal + file editor tools, native function calling) around ``LLM(base_url, api_key,
model)`` and runs it with the venv's interpreter. The working directory and HOME reach the
driver on its command line, as the agent sees them (``/tmp/work`` and ``/tmp/home`` inside bwrap):
the SDK writes its workspace path into the system prompt.
"""

from __future__ import annotations

import json
from pathlib import Path

from fineenvs.harnesses.base import OPENAI_CHAT, Harness, Launch, Outputs, with_v1, write_json

DRIVER = Path(__file__).with_name("openhands_driver.py")
CONFIG = "openhands.json"
EVENTS = "openhands_events.json"


class OpenHands(Harness):
    name = "openhands"
    package = "openhands-sdk"
    registry = "pypi"
    version = "1.58.2"
    binary = "python"
    api_formats = (OPENAI_CHAT,)
    default_format = OPENAI_CHAT
    python_version = "3.12"
    extra_requirements = ("openhands-tools==1.58.2",)
    honours_step_limit = True  # max_iteration_per_run

    def write_config(self, launch: Launch) -> None:
        self.check_format(launch.api_format)
        write_json(
            launch.home / CONFIG,
            {
                # litellm's openai/ prefix: plain Chat Completions against base_url.
                "model": f"openai/{launch.model}",
                "base_url": with_v1(launch.base_url),
                "api_key": launch.session_key,
                "max_iterations": launch.step_limit or 100,
            },
        )

    def command(self, launch: Launch) -> list[str]:
        # The config file's own folder (HOME) holds the conversation store and the event log.
        return [
            str(self.binary_path),
            "-I",
            str(DRIVER),
            str(launch.home / CONFIG),
            str(launch.workdir),
            launch.task_prompt,
        ]

    def env(self, launch: Launch) -> dict[str, str]:
        env = self.base_env(launch.home)
        env.update(
            {
                "OPENHANDS_SUPPRESS_BANNER": "1",
                "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                "LITELLM_TELEMETRY": "False",
                "LOG_LEVEL": "WARNING",
            }
        )
        return env

    def parse_outputs(self, attempt_dir: Path) -> Outputs:
        path = attempt_dir / "home" / EVENTS
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return Outputs(final_text=None, native_tool_calls=None, detail=f"no event log at {path}")
        events = data.get("events") or []
        tool_calls = sum(
            1 for e in events if e.get("kind") == "ActionEvent" and e.get("tool_name") not in (None, "finish")
        )
        final = data.get("final_response")
        return Outputs(final_text=final or None, native_tool_calls=tool_calls, detail="openhands_events.json")
