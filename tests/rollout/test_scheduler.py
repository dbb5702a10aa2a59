from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from pathlib import Path

import pytest

from fineenvs.rollout.schedule import HarnessMix, PlannedGroup, build_schedule, schedule_hash
from fineenvs.rollout.scheduler import (
    AttemptOutcome,
    AttemptPool,
    InfrastructureFailure,
    RolloutScheduler,
    RolloutState,
    ScheduleMismatch,
)

TASKS = [f"task-{i}" for i in range(10)]
MIX = HarnessMix(("opencode", "claude_code", "codex", "mini_swe_agent"), (1.0, 1.0, 1.0, 1.0))


def test_schedule_is_deterministic_and_hash_stable() -> None:
    a = build_schedule(TASKS, MIX, group_size=8, passes=2)
    b = build_schedule(list(TASKS), MIX, group_size=8, passes=2)
    assert a == b and schedule_hash(a) == schedule_hash(b)
    assert len(a) == 20 and all(len(g.attempt_ids) == 8 for g in a)
    assert len({g.group_id for g in a}) == 20
    assert len({aid for g in a for aid in g.attempt_ids}) == 160
    c = build_schedule(TASKS, MIX, group_size=4, passes=2)
    assert schedule_hash(c) != schedule_hash(a)


def test_published_rotation() -> None:
    groups = build_schedule(TASKS, MIX, group_size=8, passes=2)
    for g in groups:
        assert g.harness == MIX.names[(g.task_index + g.pass_index) % 4]
        assert g.task_id == TASKS[g.task_index]
    # each pass shifts the rotation, so a task meets a different harness each pass
    assert groups[0].harness != groups[10].harness


def test_weighted_mix_follows_weights() -> None:
    mix = HarnessMix(("a", "b"), (3.0, 1.0))
    tasks = [f"t{i}" for i in range(2000)]
    groups = build_schedule(tasks, mix, group_size=2, passes=1, selection="weighted", seed=1)
    share = Counter(g.harness for g in groups)["a"] / len(groups)
    assert 0.70 < share < 0.80
    again = build_schedule(tasks, mix, group_size=2, passes=1, selection="weighted", seed=1)
    assert [g.harness for g in again] == [g.harness for g in groups]


def test_shuffled_selection_balances_without_tying_harness_to_task_period() -> None:
    # Tasks that cycle three templates (like tasks=mini's train split) under three harnesses: the
    # rotation gives each harness one template only; shuffled gives each harness every template and
    # still each harness exactly once per block of three groups.
    mix = HarnessMix(("pi", "mini_swe_agent", "opencode"), (1.0, 1.0, 1.0))
    tasks = [f"t{i:03d}-{('rows', 'sum', 'max')[i % 3]}" for i in range(48)]
    rotation = build_schedule(tasks, mix, group_size=4, passes=1)
    assert len({(g.harness, g.task_id[-3:]) for g in rotation}) == 3  # aliased: 3 of the 9 pairs
    shuffled = build_schedule(tasks, mix, group_size=4, passes=2, selection="shuffled", seed=0)
    first = [g for g in shuffled if g.pass_index == 0]
    assert len({(g.harness, g.task_id[-3:]) for g in first}) == 9
    for start in range(0, len(shuffled), 3):
        assert sorted(g.harness for g in shuffled[start : start + 3]) == sorted(mix.names)
    again = build_schedule(tasks, mix, group_size=4, passes=2, selection="shuffled", seed=0)
    other = build_schedule(tasks, mix, group_size=4, passes=2, selection="shuffled", seed=1)
    assert [g.harness for g in again] == [g.harness for g in shuffled]
    assert [g.harness for g in other] != [g.harness for g in shuffled]
    assert schedule_hash(other) != schedule_hash(shuffled)


def test_bad_schedule_inputs() -> None:
    with pytest.raises(ValueError, match="at least one task id"):
        build_schedule([], MIX, group_size=8, passes=1)
    with pytest.raises(ValueError, match="unique"):
        build_schedule(["a", "a"], MIX, group_size=8, passes=1)
    with pytest.raises(ValueError, match="> 0"):
        HarnessMix(("a",), (0.0,))


class FakeRunner:
    def __init__(self, fail: set[int] | None = None, delay: float = 0.01) -> None:
        self.calls: list[tuple[str, int]] = []
        self.fail = fail or set()
        self.delay = delay
        self.harness_by_group: dict[str, set[str]] = {}

    async def __call__(self, group: PlannedGroup, attempt_index: int, policy_version: int) -> AttemptOutcome:
        self.calls.append((group.group_id, attempt_index))
        self.harness_by_group.setdefault(group.group_id, set()).add(group.harness)
        await asyncio.sleep(self.delay)
        if attempt_index in self.fail:
            raise RuntimeError("agent crashed")
        return AttemptOutcome(
            attempt_id=group.attempt_ids[attempt_index],
            group_id=group.group_id,
            task_id=group.task_id,
            harness=group.harness,
            policy_version=policy_version,
            reward=float(attempt_index % 2),
        )


async def _collect(sched: RolloutScheduler) -> list:
    return [g async for g in sched.groups()]


def test_inflight_bound_and_groups_complete() -> None:
    schedule = build_schedule(TASKS[:6], MIX, group_size=4, passes=1)
    runner = FakeRunner()
    sched = RolloutScheduler(schedule, runner, max_inflight=6, policy_version=lambda: 0)
    groups = asyncio.run(_collect(sched))
    assert sorted(g.planned.group_id for g in groups) == sorted(g.group_id for g in schedule)
    assert sched.peak_inflight <= 6 and sched.peak_inflight >= 4
    assert all(len(g.attempts) == 4 for g in groups)
    assert all(len(h) == 1 for h in runner.harness_by_group.values()), "one harness per group"


def test_crash_is_a_value_with_none_reward() -> None:
    schedule = build_schedule(TASKS[:2], MIX, group_size=4, passes=1)
    sched = RolloutScheduler(schedule, FakeRunner(fail={1}), max_inflight=8, policy_version=lambda: 3)
    groups = asyncio.run(_collect(sched))
    for g in groups:
        crashed = [a for a in g.attempts if a.exit_reason == "crashed"]
        assert len(crashed) == 1 and crashed[0].reward is None and "agent crashed" in (crashed[0].error or "")
        assert len(g.graded) == 3 and g.policy_version == 3


class NodeDiesOnce(FakeRunner):
    """Attempt ids in ``lose`` are lost to the infrastructure (their node died) the first time they run."""

    def __init__(self, lose: set[str], *, always: bool = False) -> None:
        super().__init__()
        self.lose = lose
        self.always = always
        self.ids: list[str] = []

    async def __call__(self, group: PlannedGroup, attempt_index: int, policy_version: int) -> AttemptOutcome:
        aid = group.attempt_ids[attempt_index]
        self.ids.append(aid)
        base = aid.split("-retry")[0]
        if base in self.lose and (self.always or aid == base):
            raise InfrastructureFailure(f"node of {aid} died")
        return await super().__call__(group, attempt_index, policy_version)


def test_an_attempt_lost_to_the_infrastructure_runs_again_under_a_fresh_id() -> None:
    schedule = build_schedule(TASKS[:3], MIX, group_size=4, passes=1)
    lost_id = schedule[1].attempt_ids[2]
    runner = NodeDiesOnce({lost_id})
    events: list[tuple[str, str]] = []
    sched = RolloutScheduler(
        schedule,
        runner,
        max_inflight=4,
        policy_version=lambda: 0,
        infra_retries=2,
        on_lost=lambda a: events.append(("lost", a.attempt_id)),
    )

    async def collect() -> list:
        out = []
        async for g in sched.groups():
            events.append(("group", g.planned.group_id))
            out.append(g)
        return out

    groups = {g.planned.group_id: g for g in asyncio.run(collect())}
    hit = groups[schedule[1].group_id]
    # The lost attempt is handed over when it is lost, before its group (a run may stop first).
    assert events.index(("lost", lost_id)) < events.index(("group", hit.planned.group_id))
    assert [e for e in events if e[0] == "lost"] == [("lost", lost_id)]
    # The lost attempt is kept (recorded, ungraded) and replaced by its rerun, a new session.
    assert [(a.attempt_id, a.exit_reason, a.reward) for a in hit.lost] == [(lost_id, "infra_failure", None)]
    assert [a.attempt_id for a in hit.attempts][2] == f"{lost_id}-retry1"
    assert len(hit.graded) == 4 and hit.attempts[2].reward == 0.0  # attempt index 2: reward 2 % 2
    assert runner.ids.count(f"{lost_id}-retry1") == 1 and f"{lost_id}-retry2" not in runner.ids
    assert all(not g.lost for gid, g in groups.items() if gid != schedule[1].group_id)
    assert sched.peak_inflight <= 4


def test_infra_reruns_are_bounded_and_a_crash_is_never_rerun() -> None:
    schedule = build_schedule(TASKS[:1], MIX, group_size=4, passes=1)
    lost_id = schedule[0].attempt_ids[0]
    runner = NodeDiesOnce({lost_id}, always=True)
    runner.fail = {3}  # the agent itself crashes: its failure, not the machinery's
    sched = RolloutScheduler(schedule, runner, max_inflight=4, policy_version=lambda: 0, infra_retries=2)
    (group,) = asyncio.run(_collect(sched))
    assert [a.attempt_id for a in group.lost] == [lost_id, f"{lost_id}-retry1"]
    assert (
        group.attempts[0].attempt_id == f"{lost_id}-retry2"
        and group.attempts[0].exit_reason == "infra_failure"
    )
    assert group.attempts[3].exit_reason == "crashed" and runner.calls.count((group.planned.group_id, 3)) == 1
    assert len(group.graded) == 2
    with pytest.raises(ValueError, match="infra_retries"):
        RolloutScheduler(schedule, runner, max_inflight=4, policy_version=lambda: 0, infra_retries=-1)


def test_resume_skips_consumed_groups(tmp_path: Path) -> None:
    schedule = build_schedule(TASKS[:4], MIX, group_size=2, passes=1)
    h = schedule_hash(schedule)
    state = RolloutState(h)
    state.mark(schedule[0].group_id, "trained")
    state.mark(schedule[2].group_id, "stale_dropped")
    path = tmp_path / "rollout_state.json"
    state.save(path)
    again = RolloutState.load_or_new(path, h)
    assert again.consumed == [schedule[0].group_id, schedule[2].group_id]
    runner = FakeRunner()
    sched = RolloutScheduler(
        schedule, runner, max_inflight=4, policy_version=lambda: 0, skip=set(again.consumed)
    )
    groups = asyncio.run(_collect(sched))
    assert {g.planned.group_id for g in groups} == {schedule[1].group_id, schedule[3].group_id}
    assert {gid for gid, _ in runner.calls}.isdisjoint(again.consumed)


def test_resume_refuses_other_schedule(tmp_path: Path) -> None:
    path = tmp_path / "rollout_state.json"
    RolloutState("a" * 64).save(path)
    with pytest.raises(ScheduleMismatch, match="different schedule"):
        RolloutState.load_or_new(path, "b" * 64)


def test_leaving_early_stops_every_attempt_even_with_a_full_ready_queue() -> None:
    """An RL run stops at max_steps with attempts in flight and finished groups queued: closing the
    stream must cancel the attempts and return at once (it used to hang at interpreter shutdown,
    the producer blocked putting its end marker into a full queue)."""
    schedule = build_schedule(TASKS, MIX, group_size=2, passes=50)
    running: set[str] = set()
    cancelled: list[str] = []

    class Slow(FakeRunner):
        async def __call__(
            self, group: PlannedGroup, attempt_index: int, policy_version: int
        ) -> AttemptOutcome:
            key = f"{group.group_id}-{attempt_index}"
            running.add(key)
            try:
                if len(self.calls) > 8:
                    await asyncio.sleep(3600)  # an agent still thinking when the run stops
                return await super().__call__(group, attempt_index, policy_version)
            except asyncio.CancelledError:
                cancelled.append(key)
                raise
            finally:
                running.discard(key)

    async def main() -> int:
        sched = RolloutScheduler(
            schedule, Slow(delay=0.0), max_inflight=4, policy_version=lambda: 0, max_ready_groups=1
        )
        seen = 0
        async with contextlib.aclosing(sched.groups()) as groups:
            async for _ in groups:
                seen += 1
                await asyncio.sleep(0.05)  # let the queue fill while the consumer works
                if seen == 2:
                    break
        # Checked here, not after asyncio.run's own clean-up: the stream itself must stop them.
        assert cancelled and not running, "every in-flight attempt was cancelled and has wound down"
        return seen

    assert asyncio.run(asyncio.wait_for(main(), timeout=10)) == 2


def test_attempt_pool_bounds_every_job_and_turns_crashes_into_outcomes() -> None:
    """The pool the scheduler, teacher collection and evaluation share: never more than its bound
    in flight, a raising runner is an ungraded ``crashed`` outcome, the version is read at start."""
    running, seen = [0], [0]

    async def runner(group: PlannedGroup, index: int, version: int) -> AttemptOutcome:
        running[0] += 1
        seen[0] = max(seen[0], running[0])
        await asyncio.sleep(0.01)
        running[0] -= 1
        if index == 1:
            raise RuntimeError("agent CLI vanished")
        return AttemptOutcome(
            group.attempt_ids[index], group.group_id, group.task_id, group.harness, version, 1.0
        )

    group = PlannedGroup(0, "g0", 0, 0, "t0", "pi", ("a0", "a1", "a2"))
    pool = AttemptPool(runner, 2)
    versions = iter(range(10, 100))

    async def main() -> list[AttemptOutcome]:
        return list(
            await asyncio.gather(*(pool.attempt(group, i % 3, lambda: next(versions)) for i in range(9)))
        )

    outcomes = asyncio.run(main())
    assert seen[0] == 2 and pool.peak_inflight == 2 and pool.inflight == 0
    crashed = [o for o in outcomes if o.exit_reason == "crashed"]
    assert len(crashed) == 3 and all(o.reward is None and o.attempt_id == "a1" for o in crashed)
    assert crashed[0].error == "RuntimeError: agent CLI vanished"
    assert sorted(o.policy_version for o in outcomes) == list(range(10, 19))
    with pytest.raises(ValueError, match="max_inflight must be >= 1"):
        AttemptPool(runner, 0)
