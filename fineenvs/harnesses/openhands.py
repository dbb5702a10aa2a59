"""OpenHands (``openhands-sdk`` + ``openhands-tools``, PyPI, Python >= 3.12): OpenAI Chat via litellm.

The SDK has no CLI of its own; :mod:`fineenvs.harnesses.openhands_driver` builds the standard
agent (terminal + file editor tools, native function calling) around ``LLM(base_url, api_key,
model)`` and runs it with the venv's interpreter. The working directory and HOME reach the
driver on its command line, as the agent sees them (``/tmp/work`` and ``/tmp/home`` inside bwrap):
the SDK writes its workspace path into the system prompt.
"""

from __future__ import annotations

from pathlib import Path

from fineenvs.harnesses.base import LITELLM_OFFLINE, Launch, Outputs, PypiHarness, with_v1
from fineenvs.harnesses.files import read_json_object
from fineenvs.jsonl import JsonObject

DRIVER = Path(__file__).with_name("openhands_driver.py")
CONFIG = "openhands.json"
EVENTS = "openhands_events.json"


class OpenHands(PypiHarness):
    name = "openhands"
    python_version = "3.12"
    extra_requirements = ("openhands-tools==1.58.2",)
    honours_step_limit = True  # max_iteration_per_run

    def config_files(self, launch: Launch, fmt: str) -> dict[str, JsonObject]:
        config = {
            # litellm's openai/ prefix: plain Chat Completions against base_url.
            "model": f"openai/{launch.model}",
            "base_url": with_v1(launch.base_url),
            "api_key": launch.session_key,
            "max_iterations": launch.step_limit or 100,
        }
        return {CONFIG: config}

    def arguments(self, launch: Launch) -> list[str]:
        # The config file's own folder (HOME) holds the conversation store and the event log.
        return ["-I", str(DRIVER), str(launch.home / CONFIG), str(launch.workdir), launch.task_prompt]

    def agent_env(self, launch: Launch) -> dict[str, str]:
        return {"OPENHANDS_SUPPRESS_BANNER": "1", **LITELLM_OFFLINE, "LOG_LEVEL": "WARNING"}

    def parse_outputs(self, attempt_dir: Path) -> Outputs:
        path = attempt_dir / "home" / EVENTS
        data = read_json_object(path)
        if data is None:
            return Outputs(final_text=None, native_tool_calls=None, detail=f"no event log at {path}")
        events = data.get("events") or []
        tool_calls = sum(
            1 for e in events if e.get("kind") == "ActionEvent" and e.get("tool_name") not in (None, "finish")
        )
        final = data.get("final_response")
        return Outputs(final_text=final or None, native_tool_calls=tool_calls, detail="openhands_events.json")
