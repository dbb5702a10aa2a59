"""One attempt, end to end: proxy session → real agent CLI in its sandbox → grade → reward → rows.

``ProxyAttemptRunner`` is the scheduler's ``AttemptRunner`` for real runs. It talks to the capture
proxy over its control plane (the proxy is a separate process: a crash of this one loses no
recorded call), runs the agent in a worker thread (``fineenvs.harnesses.sandbox.run_attempt``),
grades ``answer.txt`` outside the sandbox (the agent never sees the gold answer), computes the
reward (``None`` when no grade is possible — never a silent 0), and turns the session's recorded
calls into training rows with the run's row options. Everything that goes wrong is returned as a
value on the ``AttemptOutcome``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

__all__ = ["AttemptSettings", "ProxyAttemptRunner", "calls_to_nodes"]

from fineenvs.jsonl import JsonObject
from fineenvs.rollout.schedule import PlannedGroup
from fineenvs.rollout.scheduler import AttemptOutcome, InfrastructureFailure
from fineenvs.trajectory.record import CallRecord, calls_to_nodes
from fineenvs.trajectory.rows import Row

if TYPE_CHECKING:
    from fineenvs.harnesses.container import DockerSettings
    from fineenvs.harnesses.sandbox import AttemptResult
    from fineenvs.rollout.ray_backend import RayAttempts
    from fineenvs.tasks.grader import Grade
    from fineenvs.tasks.model import Task


@dataclass
class AttemptSettings:
    proxy_url: str
    admin_key: str | None
    served_model: str
    attempts_dir: Path
    timeout_seconds: float
    max_model_calls: int
    api_formats: dict[str, str]
    """harness name -> wire format to use."""
    step_limits: dict[str, int | None]
    use_bwrap: bool = False
    docker: DockerSettings | None = None
    """Set: every attempt in a container (``scheduler.sandbox=docker``)."""
    remote: RayAttempts | None = None
    """``scheduler.backend=ray``: attempts run on the cluster's rollout nodes; None: in this process."""


class ProxyAttemptRunner:
    def __init__(
        self,
        settings: AttemptSettings,
        *,
        tasks: dict[str, Task],
        reward_fn: Any,
        row_options: Any,
    ) -> None:
        self.settings = settings
        self.tasks = tasks
        self.reward_fn = reward_fn
        self.row_options = row_options
        headers = {"Authorization": f"Bearer {settings.admin_key}"} if settings.admin_key else {}
        self.client = httpx.AsyncClient(base_url=settings.proxy_url, headers=headers, timeout=60.0)

    async def aclose(self) -> None:
        await self.client.aclose()

    async def __call__(self, group: PlannedGroup, attempt_index: int, policy_version: int) -> AttemptOutcome:
        """One attempt: a proxy session, the agent in its sandbox, the rows of its calls, the grade."""
        attempt_id = group.attempt_ids[attempt_index]
        task = self.tasks[group.task_id]
        outcome = AttemptOutcome(
            attempt_id=attempt_id,
            group_id=group.group_id,
            task_id=group.task_id,
            harness=group.harness,
            policy_version=policy_version,
            reward=None,
        )
        started = time.monotonic()
        session = await self._open_session(group, attempt_id, policy_version)
        attempt_dir = self.settings.attempts_dir / group.group_id / attempt_id
        result, rollout = await self._run_agent(group, task, session, attempt_dir)
        if result.exit_reason == "infra_failure":  # the sandbox never ran the agent: no grade, not a 0
            raise InfrastructureFailure(f"attempt {attempt_id}: {result.detail}")
        outcome.exit_reason = result.exit_reason
        outcome.model_calls = result.proxy_model_calls or 0
        outcome.duration_seconds = time.monotonic() - started
        _count_tool_calls(outcome, result)
        calls: list[CallRecord] = rollout.get("calls", [])
        outcome.rows, outcome.metrics = self._rows(calls, outcome)
        if result.exit_reason == "wiring_failure":
            outcome.error = f"{group.harness} made no model call: wiring failure ({result.detail})"
            return outcome
        grade = await asyncio.to_thread(self._grade, task, attempt_dir / "work")
        correct = grade.score
        if correct is None:
            outcome.error = f"ungraded: {grade.reason}"
        reward = self.reward_fn(correct, outcome.tool_calls, outcome.tool_calls_verified)
        outcome.reward = reward.reward
        outcome.reward_terms = dict(reward.terms)
        return outcome

    def sampling_seed(self, group: PlannedGroup, attempt_id: str) -> int | None:
        """The session's ``sampling_seed`` (the proxy seeds each of its calls from it), or None for
        the engine's own stream: training wants a group's attempts to draw independently."""
        return None

    async def _open_session(self, group: PlannedGroup, attempt_id: str, policy_version: int) -> JsonObject:
        """A proxy session for the attempt: its key, base URL and model-call budget."""
        body: JsonObject = {
            "task": group.task_id,
            "group": group.group_id,
            "harness": group.harness,
            "attempt": attempt_id,
            "policy_version": policy_version,
            "max_model_calls": self.settings.max_model_calls,
        }
        seed = self.sampling_seed(group, attempt_id)
        if seed is not None:
            body["sampling_seed"] = seed
        resp = await self.client.post("/sessions", json=body)
        resp.raise_for_status()
        session: JsonObject = resp.json()
        return session

    async def _run_agent(
        self, group: PlannedGroup, task: Task, session: JsonObject, attempt_dir: Path
    ) -> tuple[AttemptResult, JsonObject]:
        """Run the agent in its sandbox (a worker thread); returns its result and the proxy's record
        of the session's calls."""
        from fineenvs.harnesses import get_harness
        from fineenvs.harnesses.sandbox import ProxyStats, proxy_stats_from_rollout, run_attempt

        s = self.settings
        rollout_url = f"/sessions/{session['session_id']}/rollout?trajectory=false"
        loop = asyncio.get_running_loop()
        rollout: JsonObject = {}

        def proxy_stats() -> ProxyStats | None:
            # Called from the worker thread once the agent's process group is gone: fetch what the
            # proxy recorded (on the loop that owns the client).
            fut = asyncio.run_coroutine_threadsafe(self.client.get(rollout_url), loop)
            rollout.update(fut.result(timeout=60).json())
            return proxy_stats_from_rollout(rollout)

        kwargs: dict[str, Any] = dict(
            task_prompt=task.instruction,
            input_files=task.input_files,
            attempt_dir=attempt_dir,
            base_url=session["base_url"],
            session_key=session["key"],
            model=s.served_model,
            api_format=s.api_formats.get(group.harness),
            timeout_seconds=s.timeout_seconds,
            step_limit=s.step_limits.get(group.harness),
            use_bwrap=s.use_bwrap,
            docker=s.docker,
            task_id=task.task_id,
            environment=task.environment,
        )
        if s.remote is not None:
            result, rollout = await s.remote.run(group.harness, kwargs, rollout_url)
        else:
            result = await asyncio.to_thread(
                run_attempt, get_harness(group.harness), **kwargs, proxy_stats=proxy_stats
            )
        if not rollout:
            rollout = (await self.client.get(rollout_url)).json()
        return result, rollout

    def _grade(self, task: Task, workdir: Path) -> Grade:
        from fineenvs.tasks.grader import grade_workdir

        return grade_workdir(task, workdir)

    def _rows(self, calls: list[CallRecord], outcome: AttemptOutcome) -> tuple[list[Row], dict[str, float]]:
        from fineenvs.trajectory import build_session

        nodes = calls_to_nodes(calls)
        metadata = {
            "attempt": outcome.attempt_id,
            "group": outcome.group_id,
            "task": outcome.task_id,
            "harness": outcome.harness,
            "policy_version": outcome.policy_version,
        }
        session = build_session(nodes, metadata, self.row_options)
        m = session.metrics
        metrics = {
            "rows": float(m.n_rows),
            "trainable_rows": float(m.n_trainable_rows),
            "trainable_token_fraction": m.trainable_token_fraction,
            "roots": float(m.n_roots),
            "forks": float(m.n_forks),
            "discarded": float(m.n_discarded),
            "drift_breaks": float(len(m.drift_breaks)),
            "sampled_tokens": float(m.sampled_tokens),
            "constrained_calls": float(m.n_constrained),
        }
        timings = [t for c in calls if (t := c.get("timings"))]
        proxy_s = [float(t["proxy_s"]) for t in timings]
        upstream_s = [float(t["upstream_s"]) for t in timings]
        if proxy_s:
            metrics["proxy_ms"] = 1000.0 * sum(proxy_s) / len(proxy_s)
        if upstream_s:
            metrics["upstream_s"] = sum(upstream_s) / len(upstream_s)
        return session.training_rows(), metrics


def _count_tool_calls(outcome: AttemptOutcome, result: AttemptResult) -> None:
    """Tool calls: the agent's own log is the verified count (published: ATIF); the proxy's count of
    emitted tool calls is the fallback, and a disagreement leaves it unverified."""
    if result.native_tool_calls is not None:
        outcome.tool_calls = result.native_tool_calls
        outcome.tool_calls_verified = not result.tool_calls_disagree
    else:
        outcome.tool_calls = result.proxy_tool_calls
        outcome.tool_calls_verified = False
