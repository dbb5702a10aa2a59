"""Mini-SWE-Agent (``mini-swe-agent``, PyPI): Chat or Messages through litellm, honours a step limit."""

from __future__ import annotations

from pathlib import Path

from fineenvs.harnesses.base import (
    LITELLM_OFFLINE,
    SDK_KEY_ENV,
    Launch,
    Outputs,
    PypiHarness,
    litellm_model,
    sdk_base_url,
)
from fineenvs.harnesses.files import read_json_object, typed_blocks
from fineenvs.jsonl import JsonObject

TRAJECTORY = "mini_trajectory.json"
# mini reads its settings from files named in -c; the parameters file keeps the base URL and the
# limits out of argv (argv is visible to every process on the host, a file under HOME is not).
PARAMS = "mini_params.yaml"
HEADLESS_FLAGS = ("-y", "--exit-immediately")


class MiniSweAgent(PypiHarness):
    name = "mini_swe_agent"
    honours_step_limit = True  # agent.step_limit

    def config_files(self, launch: Launch, fmt: str) -> dict[str, JsonObject]:
        api_base = sdk_base_url(fmt, launch.base_url)
        params = {
            "agent": {"step_limit": launch.step_limit or 0, "cost_limit": 0, "mode": "yolo"},
            "model": {"model_kwargs": {"api_base": api_base, "drop_params": True}},
        }
        return {PARAMS: params}

    def arguments(self, launch: Launch) -> list[str]:
        model = litellm_model(self.check_format(launch.api_format), launch.model)
        # -c replaces the default config, so the built-in mini.yaml must come first.
        files = ["-c", "mini.yaml", "-c", str(launch.home / PARAMS), "-o", str(launch.home / TRAJECTORY)]
        return ["-m", model, "-t", launch.task_prompt, *HEADLESS_FLAGS, *files]

    def agent_env(self, launch: Launch) -> dict[str, str]:
        fmt = self.check_format(launch.api_format)
        return {
            SDK_KEY_ENV[fmt]: launch.session_key,
            "MSWEA_CONFIGURED": "true",
            "MSWEA_COST_TRACKING": "ignore_errors",
            "MSWEA_GLOBAL_CONFIG_DIR": str(launch.home / ".config" / "mini-swe-agent"),
            **LITELLM_OFFLINE,
        }

    def parse_outputs(self, attempt_dir: Path) -> Outputs:
        path = attempt_dir / "home" / TRAJECTORY
        traj = read_json_object(path)
        if traj is None:
            return Outputs(final_text=None, native_tool_calls=None, detail=f"no trajectory at {path}")
        tool_calls = 0
        for msg in traj.get("messages") or []:
            if isinstance(msg, dict) and msg.get("role") == "assistant":
                tool_calls += len(msg.get("tool_calls") or []) + len(
                    typed_blocks(msg.get("content"), "tool_use")
                )
        info = traj.get("info") or {}
        final = info.get("submission")
        return Outputs(
            final_text=final if isinstance(final, str) else None,
            native_tool_calls=tool_calls,
            detail=f"exit_status={info.get('exit_status')}",
        )
