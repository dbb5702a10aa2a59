"""Mini-SWE-Agent (``mini-swe-agent``, PyPI): Chat or Messages through litellm, honours a step limit."""

from __future__ import annotations

import json
from pathlib import Path

from fineenvs.harnesses.base import (
    ANTHROPIC_MESSAGES,
    OPENAI_CHAT,
    Harness,
    Launch,
    Outputs,
    strip_v1,
    with_v1,
    write_json,
)

TRAJECTORY = "mini_trajectory.json"
# mini reads its settings from files named in -c; the parameters file keeps the base URL and the
# limits out of argv (argv is visible to every process on the host, a file under HOME is not).
PARAMS = "mini_params.yaml"


class MiniSweAgent(Harness):
    name = "mini_swe_agent"
    package = "mini-swe-agent"
    registry = "pypi"
    version = "2.4.6"
    binary = "mini"
    api_formats = (OPENAI_CHAT, ANTHROPIC_MESSAGES)
    default_format = OPENAI_CHAT
    honours_step_limit = True  # agent.step_limit

    def write_config(self, launch: Launch) -> None:
        fmt = self.check_format(launch.api_format)
        api_base = with_v1(launch.base_url) if fmt == OPENAI_CHAT else strip_v1(launch.base_url)
        # YAML is a superset of JSON, so a JSON document is a valid -c file.
        write_json(
            launch.home / PARAMS,
            {
                "agent": {"step_limit": launch.step_limit or 0, "cost_limit": 0, "mode": "yolo"},
                "model": {"model_kwargs": {"api_base": api_base, "drop_params": True}},
            },
        )

    def command(self, launch: Launch) -> list[str]:
        fmt = self.check_format(launch.api_format)
        prefix = "openai" if fmt == OPENAI_CHAT else "anthropic"
        # -c replaces the default config, so the built-in mini.yaml must come first.
        return [
            str(self.binary_path),
            "-m",
            f"{prefix}/{launch.model}",
            "-t",
            launch.task_prompt,
            "-y",
            "--exit-immediately",
            "-c",
            "mini.yaml",
            "-c",
            str(launch.home / PARAMS),
            "-o",
            str(launch.home / TRAJECTORY),
        ]

    def env(self, launch: Launch) -> dict[str, str]:
        fmt = self.check_format(launch.api_format)
        env = self.base_env(launch.home)
        env.update(
            {
                "OPENAI_API_KEY" if fmt == OPENAI_CHAT else "ANTHROPIC_API_KEY": launch.session_key,
                "MSWEA_CONFIGURED": "true",
                "MSWEA_COST_TRACKING": "ignore_errors",
                "MSWEA_GLOBAL_CONFIG_DIR": str(launch.home / ".config" / "mini-swe-agent"),
                "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                "LITELLM_TELEMETRY": "False",
            }
        )
        return env

    def parse_outputs(self, attempt_dir: Path) -> Outputs:
        path = attempt_dir / "home" / TRAJECTORY
        try:
            traj = json.loads(path.read_text())
        except (OSError, ValueError):
            return Outputs(final_text=None, native_tool_calls=None, detail=f"no trajectory at {path}")
        messages = traj.get("messages") or []
        tool_calls = 0
        for msg in messages:
            if isinstance(msg, dict) and msg.get("role") == "assistant":
                tool_calls += len(msg.get("tool_calls") or [])
                for block in msg.get("content") or [] if isinstance(msg.get("content"), list) else []:
                    if isinstance(block, dict) and block.get("type") == "tool_use":
                        tool_calls += 1
        info = traj.get("info") or {}
        final = info.get("submission")
        status = info.get("exit_status")
        return Outputs(
            final_text=final if isinstance(final, str) else None,
            native_tool_calls=tool_calls,
            detail=f"exit_status={status}",
        )
