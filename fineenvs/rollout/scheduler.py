"""Runs the schedule: attempts concurrently up to ``max_inflight``, groups handed over when complete.

The scheduler knows nothing about agents, proxies or graders: an ``AttemptRunner`` runs one
attempt and returns an ``AttemptOutcome`` (a value, also when the attempt crashed or timed out —
failures are values). The scheduler starts groups in schedule order, bounds the attempts in
flight, and yields each group when all its attempts have finished, stamped with the oldest policy
version any of its attempts started under (what staleness is measured against).

Resume: ``RolloutState`` records the schedule hash and every group already consumed (trained on,
or dropped as stale / without signal). A restarted run skips those groups, so it never replays a
group it trained on; a different schedule hash is refused with a message.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from fineenvs.rollout.schedule import PlannedGroup
from fineenvs.trajectory.rows import Row


class InfrastructureFailure(RuntimeError):
    """The attempt was lost to the machinery that runs it (a dead rollout node, a task no node
    took), not to the agent: ungraded, ``exit_reason=infra_failure``, never a 0 reward."""


@dataclass
class AttemptOutcome:
    attempt_id: str
    group_id: str
    task_id: str
    harness: str
    policy_version: int
    reward: float | None
    """None: no grade (crash, timeout before an answer could be graded, grader failure)."""
    reward_terms: dict[str, float | None] = field(default_factory=dict)
    exit_reason: str = "finished"
    rows: list[Row] = field(default_factory=list)
    """The attempt's trainable rows (none for evaluation attempts)."""
    tool_calls: int | None = None
    tool_calls_verified: bool = False
    duration_seconds: float = 0.0
    model_calls: int = 0
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    @classmethod
    def crashed(
        cls, group: PlannedGroup, index: int, policy_version: int, err: BaseException
    ) -> AttemptOutcome:
        """Attempt ``index`` of ``group`` whose runner raised: an ungraded outcome, never an exception
        out of a concurrency loop (RL scheduler, teacher collection, evaluation cells)."""
        return cls(
            attempt_id=group.attempt_ids[index],
            group_id=group.group_id,
            task_id=group.task_id,
            harness=group.harness,
            policy_version=policy_version,
            reward=None,
            exit_reason="infra_failure" if isinstance(err, InfrastructureFailure) else "crashed",
            error=f"{type(err).__name__}: {err}",
        )


@dataclass
class GroupOutcome:
    planned: PlannedGroup
    attempts: list[AttemptOutcome]
    lost: list[AttemptOutcome] = field(default_factory=list)
    """Attempts lost to the infrastructure and run again under a fresh id (``scheduler.infra_retries``),
    already handed to the scheduler's ``on_lost`` when lost; ``attempts`` holds what replaced them."""

    @property
    def policy_version(self) -> int:
        return min(a.policy_version for a in self.attempts)

    @property
    def graded(self) -> list[AttemptOutcome]:
        return [a for a in self.attempts if a.reward is not None]

    @property
    def num_rows(self) -> int:
        return sum(len(a.rows) for a in self.attempts)

    def signal(self) -> str:
        """Whether the group can teach anything, from its graded rewards.

        ``"signal"``: the rewards differ, so advantages are non-zero. Otherwise every row trains
        with advantage 0: ``"too_few_graded"`` (under two graded attempts), ``"all_correct"``
        (every graded attempt fully correct and equal rewards: the published runs count 97 and
        155 such groups), ``"all_zero"`` (every reward 0: the usual case of an untrained model)
        or ``"all_equal"`` (the same non-zero reward, e.g. equal partial credit).
        """
        graded = self.graded
        if len(graded) < 2:
            return "too_few_graded"
        rewards = [a.reward for a in graded if a.reward is not None]
        if max(rewards) - min(rewards) > 1e-12:
            return "signal"
        if all((a.reward_terms.get("correctness") or 0.0) >= 1.0 for a in graded):
            return "all_correct"
        return "all_zero" if rewards[0] == 0.0 else "all_equal"


Tried = tuple[AttemptOutcome, list[AttemptOutcome]]
"""An attempt's last outcome and the outcomes lost to the infrastructure before it."""

AttemptRunner = Callable[[PlannedGroup, int, int], Awaitable["AttemptOutcome"]]
"""``(group, attempt_index, policy_version) -> outcome``: runs one attempt (``ProxyAttemptRunner``)."""


class ScheduleMismatch(RuntimeError):
    pass


@dataclass
class RolloutState:
    """What a resumed run needs: the schedule fingerprint and the groups already consumed."""

    schedule_hash: str
    consumed: list[str] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)

    def mark(self, group_id: str, counter: str | None = None) -> None:
        if group_id not in self.consumed:
            self.consumed.append(group_id)
        if counter:
            self.counters[counter] = self.counters.get(counter, 0) + 1

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(
            json.dumps(
                {"schedule_hash": self.schedule_hash, "consumed": self.consumed, "counters": self.counters}
            )
        )
        os.replace(tmp, path)

    @classmethod
    def load_or_new(cls, path: Path, schedule_hash: str) -> RolloutState:
        if not path.exists():
            return cls(schedule_hash)
        data = json.loads(path.read_text())
        if data["schedule_hash"] != schedule_hash:
            raise ScheduleMismatch(
                f"{path} belongs to a run with a different schedule (hash {data['schedule_hash'][:12]}, this "
                f"config gives {schedule_hash[:12]}): the task list, harness mix, group size, passes or seed "
                "changed, so resuming would train on a different sequence of groups. Resume with the original "
                "config, or start in a new output directory."
            )
        return cls(data["schedule_hash"], list(data["consumed"]), dict(data.get("counters", {})))


class AttemptPool:
    """The one place attempts run, for every job: at most ``max_inflight`` at a time, and a runner
    that raises gives an ungraded ``crashed`` outcome instead of an exception.

    The RL scheduler (groups in schedule order), teacher collection (a pair's attempts in turn until
    one is correct) and evaluation (a cell's tries until one is graded) differ only in which attempt
    they ask for next; they all run it here. ``take()`` waits for a slot (callers that must keep an
    order take it before creating the task); ``run()`` runs in a taken slot and gives it back.
    """

    def __init__(self, runner: AttemptRunner, max_inflight: int) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1 (got {max_inflight})")
        self.runner = runner
        self.max_inflight = max_inflight
        self._slots = asyncio.Semaphore(max_inflight)
        self.inflight = 0
        self.peak_inflight = 0

    async def take(self) -> None:
        await self._slots.acquire()

    async def run(
        self, group: PlannedGroup, index: int, policy_version: int | Callable[[], int]
    ) -> AttemptOutcome:
        """Attempt ``index`` of ``group`` in a slot taken with ``take()`` (released here, always).
        ``policy_version`` may be a callable, read when the attempt starts."""
        self.inflight += 1
        self.peak_inflight = max(self.peak_inflight, self.inflight)
        try:
            version = policy_version() if callable(policy_version) else policy_version
            try:
                return await self.runner(group, index, version)
            except Exception as err:  # noqa: BLE001 - a runner bug must not end the job: it is a value
                return AttemptOutcome.crashed(group, index, version, err)
        finally:
            self.inflight -= 1
            self._slots.release()

    async def attempt(
        self, group: PlannedGroup, index: int, policy_version: int | Callable[[], int]
    ) -> AttemptOutcome:
        """``take()`` then ``run()``."""
        await self.take()
        return await self.run(group, index, policy_version)

    async def run_retrying(
        self,
        group: PlannedGroup,
        index: int,
        policy_version: Callable[[], int],
        retries: int,
        on_lost: Callable[[AttemptOutcome], None] | None = None,
    ) -> tuple[AttemptOutcome, list[AttemptOutcome]]:
        """``run()``, and up to ``retries`` more runs while the attempt is lost to the infrastructure
        (a dead rollout node): each under a fresh attempt id (``<id>-retry<n>``: a new session and
        folder, never a second agent against the first one's session), in slots taken anew. Returns
        the last outcome and the lost ones. ``on_lost`` gets each lost one at once: its record must
        not wait for a group the run may stop before it finishes."""
        outcome = await self.run(group, index, policy_version)
        lost: list[AttemptOutcome] = []
        for n in range(1, retries + 1):
            if outcome.exit_reason != "infra_failure":
                break
            lost.append(outcome)
            if on_lost is not None:
                on_lost(outcome)
            ids = list(group.attempt_ids)
            ids[index] = f"{group.attempt_ids[index]}-retry{n}"
            outcome = await self.attempt(replace(group, attempt_ids=tuple(ids)), index, policy_version)
        return outcome, lost


class RolloutScheduler:
    def __init__(
        self,
        schedule: list[PlannedGroup],
        runner: AttemptRunner,
        *,
        max_inflight: int,
        policy_version: Callable[[], int],
        skip: set[str] | None = None,
        max_ready_groups: int = 8,
        infra_retries: int = 0,
        on_lost: Callable[[AttemptOutcome], None] | None = None,
    ) -> None:
        if max_inflight < 1:
            raise ValueError("max_inflight must be >= 1")
        if infra_retries < 0:
            raise ValueError(f"infra_retries must be >= 0 (got {infra_retries})")
        self.infra_retries = infra_retries
        self.on_lost = on_lost
        self.schedule = schedule
        self.runner = runner
        self.max_inflight = max_inflight
        self.policy_version = policy_version
        self.skip = set(skip or ())
        self.pool = AttemptPool(runner, max_inflight)
        self._ready: asyncio.Queue[GroupOutcome | None] = asyncio.Queue(maxsize=max(1, max_ready_groups))

    @property
    def inflight(self) -> int:
        return self.pool.inflight

    @property
    def peak_inflight(self) -> int:
        return self.pool.peak_inflight

    @property
    def pending(self) -> list[PlannedGroup]:
        return [g for g in self.schedule if g.group_id not in self.skip]

    async def groups(self) -> AsyncGenerator[GroupOutcome, None]:
        """Yield finished groups (in completion order) until the schedule is exhausted."""
        producer = asyncio.create_task(self._produce())
        try:
            while True:
                item = await self._ready.get()
                if item is None:
                    break
                yield item
            await producer
        finally:
            if not producer.done():
                producer.cancel()
                try:
                    await producer
                except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down
                    pass

    async def _produce(self) -> None:
        group_tasks: list[asyncio.Task[None]] = []

        async def run_group(group: PlannedGroup, started: list[asyncio.Task[Tried]]) -> None:
            tried = await asyncio.gather(*started)
            lost = [a for _, lost in tried for a in lost]
            await self._ready.put(GroupOutcome(group, [outcome for outcome, _ in tried], lost))

        attempt_tasks: list[asyncio.Task[Tried]] = []
        try:
            for group in self.pending:
                started = []
                for index in range(len(group.attempt_ids)):
                    await self.pool.take()  # in schedule order: the slot before the task
                    started.append(
                        asyncio.create_task(
                            self.pool.run_retrying(
                                group, index, self.policy_version, self.infra_retries, self.on_lost
                            )
                        )
                    )
                    attempt_tasks.append(started[-1])
                group_tasks.append(asyncio.create_task(run_group(group, started)))
            await asyncio.gather(*group_tasks)
        except BaseException:
            # Stopped (the consumer left, Ctrl-C): cancel what runs and wait for it to wind down,
            # so no attempt outlives the scheduler. The end marker is best effort: nobody may be
            # reading, and a full queue must not hang the shutdown.
            for t in (*attempt_tasks, *group_tasks):
                t.cancel()
            await asyncio.gather(*attempt_tasks, *group_tasks, return_exceptions=True)
            try:
                self._ready.put_nowait(None)
            except asyncio.QueueFull:
                pass
            raise
        await self._ready.put(None)
