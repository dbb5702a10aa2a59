"""A sandbox that never started the agent (``exit_reason=infra_failure`` from ``run_attempt``) is
the machinery's failure: the attempt runner raises ``InfrastructureFailure``, and the pool records
it ungraded with ``exit_reason=infra_failure``, never a 0 reward."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from fineenvs.harnesses.sandbox import AttemptResult
from fineenvs.rollout.attempt import AttemptSettings, ProxyAttemptRunner
from fineenvs.rollout.schedule import PlannedGroup
from fineenvs.rollout.scheduler import AttemptPool, InfrastructureFailure


def _runner(tmp_path: Path, exit_reason: str, monkeypatch: pytest.MonkeyPatch) -> ProxyAttemptRunner:
    settings = AttemptSettings(
        proxy_url="http://127.0.0.1:9",
        admin_key=None,
        served_model="m",
        attempts_dir=tmp_path,
        timeout_seconds=10,
        max_model_calls=5,
        api_formats={},
        step_limits={},
    )
    graded: list[float] = []
    runner = ProxyAttemptRunner(
        settings, tasks={"t1": object()}, reward_fn=lambda *a: graded.append(1.0), row_options=None
    )
    result = AttemptResult(
        harness="h", exit_reason=exit_reason, returncode=125, duration_s=0.1, answer=None, final_text=None,
        proxy_model_calls=0, proxy_tool_calls=0, native_tool_calls=None, tool_calls_disagree=False,
        attempt_dir=str(tmp_path), detail="the container did not start (docker run exited 125): no image",
    )  # fmt: skip

    async def session(*a: Any) -> dict[str, str]:
        return {"session_id": "s", "key": "k", "base_url": "http://127.0.0.1:9/s/k"}

    async def run_agent(*a: Any) -> tuple[AttemptResult, dict[str, Any]]:
        return result, {}

    monkeypatch.setattr(runner, "_open_session", session)
    monkeypatch.setattr(runner, "_run_agent", run_agent)
    return runner


def test_a_sandbox_that_did_not_start_is_an_infra_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = _runner(tmp_path, "infra_failure", monkeypatch)
    group = PlannedGroup(0, "g0", 0, 0, "t1", "h", ("g0-try0",))
    with pytest.raises(InfrastructureFailure, match="docker run exited 125"):
        asyncio.run(runner(group, 0, 0))
    outcome = asyncio.run(AttemptPool(runner, 1).attempt(group, 0, 0))
    assert outcome.exit_reason == "infra_failure" and outcome.reward is None
    assert outcome.error is not None and "no image" in outcome.error
    asyncio.run(runner.aclose())
