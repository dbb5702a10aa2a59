from __future__ import annotations

from types import SimpleNamespace

import pytest

from fineenvs.jobs.errors import RunAborted
from fineenvs.jobs.rl import GroupAdmission, LoopStats, _stamp_rows
from fineenvs.rollout.schedule import PlannedGroup
from fineenvs.rollout.scheduler import AttemptOutcome, GroupOutcome, RolloutState


def _row(n: int = 4) -> SimpleNamespace:
    return SimpleNamespace(
        input_ids=list(range(n)),
        loss_mask=[0, 0] + [1] * (n - 2),
        logprobs=[0.0, 0.0] + [-0.5] * (n - 2),
        loss_weight=None,
    )


def _group(i: int, rewards: list[float | None], rows_per_attempt: int = 1, version: int = 0) -> GroupOutcome:
    gid = f"g{i}"
    planned = PlannedGroup(
        i, gid, 0, i, f"t{i}", "opencode", tuple(f"{gid}-a{k}" for k in range(len(rewards)))
    )
    attempts = [
        AttemptOutcome(
            attempt_id=f"{gid}-a{k}",
            group_id=gid,
            task_id=f"t{i}",
            harness="opencode",
            policy_version=version,
            reward=r,
            rows=[_row() for _ in range(rows_per_attempt)],
        )
        for k, r in enumerate(rewards)
    ]
    return GroupOutcome(planned, attempts)


def _admission(rows_per_step: int = 4, max_staleness: int = 4, max_empty: int = 3) -> GroupAdmission:
    return GroupAdmission(
        max_staleness=max_staleness,
        rows_per_step=rows_per_step,
        max_consecutive_empty=max_empty,
        stats=LoopStats(),
        state=RolloutState("h"),
    )


def test_batch_forms_when_enough_rows() -> None:
    adm = _admission(rows_per_step=4)
    assert adm.offer(_group(0, [1.0, 0.0]), policy_version=0) is None
    batch = adm.offer(_group(1, [0.0, 1.0]), policy_version=0)
    assert batch is not None and [g.planned.group_id for g in batch] == ["g0", "g1"]
    assert adm.pending == []


def test_stale_group_dropped_and_counted() -> None:
    adm = _admission(max_staleness=2)
    assert adm.offer(_group(0, [1.0, 0.0], version=1), policy_version=4) is None
    assert adm.stats.stale_dropped == 1 and adm.state.consumed == ["g0"]
    assert adm.state.counters["stale_dropped"] == 1


def test_ungraded_attempts_excluded_and_no_signal_counted() -> None:
    adm = _admission(rows_per_step=1)
    assert adm.offer(_group(0, [None, 1.0]), policy_version=0) is None
    assert adm.stats.no_signal == 1 and adm.stats.empty_groups == 1
    batch = adm.offer(_group(1, [None, 1.0, 0.0]), policy_version=0)
    assert batch is not None
    rows = _stamp_rows(batch, "group")
    assert len(rows) == 2, "the ungraded attempt's rows are not trained"
    assert sorted(r.advantage for r in rows)[0] < 0 < sorted(r.advantage for r in rows)[1]


def test_abort_after_consecutive_empty_groups() -> None:
    adm = _admission(max_empty=3)
    adm.offer(_group(0, [None, None]), 0)
    adm.offer(_group(1, [1.0, 0.0], rows_per_attempt=0), 0)
    with pytest.raises(RunAborted, match="3 consecutive groups"):
        adm.offer(_group(2, [None, 0.0]), 0)


def test_trainable_group_resets_empty_streak() -> None:
    adm = _admission(max_empty=2, rows_per_step=100)
    adm.offer(_group(0, [None, None]), 0)
    adm.offer(_group(1, [1.0, 0.0]), 0)
    adm.offer(_group(2, [None, None]), 0)
    assert adm.stats.consecutive_empty == 1


def test_multi_row_attempt_rows_share_one_advantage() -> None:
    group = _group(0, [1.0, 0.0, 0.0, 1.0], rows_per_attempt=3)
    rows = _stamp_rows([group], "group")
    assert len(rows) == 12
    by_attempt: dict[str, set[float]] = {}
    for r in rows:
        by_attempt.setdefault(r.attempt_id, set()).add(r.advantage)
    assert all(len(v) == 1 for v in by_attempt.values())
    assert by_attempt["g0-a0"] == by_attempt["g0-a3"] and by_attempt["g0-a0"] != by_attempt["g0-a1"]


def _correct_group(i: int, correct: list[float], harness: str = "opencode") -> GroupOutcome:
    """Rewards from the correctness term, as the reward function records them."""
    g = _group(i, list(correct))
    for a, c in zip(g.attempts, correct, strict=True):
        a.reward_terms["correctness"] = c
        a.harness = harness
    return GroupOutcome(
        PlannedGroup(i, g.planned.group_id, 0, i, f"t{i}", harness, g.planned.attempt_ids), g.attempts
    )


def test_all_equal_groups_are_counted_without_signal_per_harness() -> None:
    """All-zero (the untrained model's case) and all-correct groups train with advantage 0: counted
    per step and per harness, and their rows show up as zero-advantage rows."""
    from fineenvs.jobs.rl import advantage_metrics, group_metrics

    adm = _admission(rows_per_step=8)
    groups = [
        _correct_group(0, [0.0, 0.0, 0.0], "opencode"),
        _correct_group(1, [1.0, 1.0], "opencode"),
        _correct_group(2, [1.0, 0.0], "codex"),
        _correct_group(3, [0.0, 0.0], "codex"),
    ]
    batch = None
    for g in groups:
        batch = adm.offer(g, policy_version=0) or batch
    assert batch is not None and len(batch) == 4, "all-equal groups still train (their rows count)"
    assert adm.stats.no_signal == 3
    assert dict(adm.stats.signal_kinds) == {"all_zero": 2, "all_correct": 1, "signal": 1}
    m = group_metrics(batch)
    assert m["rollout/harness/opencode/groups_no_signal"] == 2.0
    assert m["rollout/harness/opencode/groups_all_correct"] == 1.0
    assert m["rollout/harness/opencode/groups_all_zero"] == 1.0
    assert m["rollout/harness/codex/groups_no_signal"] == 1.0
    assert m["rollout/harness/codex/groups"] == 2.0
    rows = _stamp_rows(batch, "group")
    a = advantage_metrics(rows, {g.planned.group_id: g.planned.harness for g in batch})
    assert a["train/harness/opencode/rows_zero_advantage"] == 5.0 == a["train/harness/opencode/rows"]
    assert a["train/harness/codex/rows_zero_advantage"] == 2.0 and a["train/harness/codex/rows"] == 4.0
    assert a["train/rows_zero_advantage"] == 7.0


def test_unequal_partial_credit_has_signal_and_equal_partial_does_not() -> None:
    assert _group(0, [0.5, 0.5]).signal() == "all_equal"
    assert _group(1, [0.5, 0.25]).signal() == "signal"
    assert _group(2, [None, 1.0]).signal() == "too_few_graded"


def test_summary_says_why_a_tiny_models_reward_is_0() -> None:
    from fineenvs.config import ModelSource
    from fineenvs.jobs.rl import zero_reward_reason

    stats = LoopStats(rewards=[0.0, 0.0])
    run = SimpleNamespace(model=SimpleNamespace(source=ModelSource.tiny, path="tiny_qwen"))
    why = zero_reward_reason(run, stats)  # type: ignore[arg-type]
    assert why is not None and "randomly initialised" in why and "mini_repro" in why
    assert zero_reward_reason(run, LoopStats(rewards=[0.0, 1.0])) is None  # type: ignore[arg-type]


def test_dynamic_sampling_leaves_groups_without_signal_out_of_the_batch() -> None:
    """trainer.dynamic_sampling (DAPO): all-zero and all-correct groups are counted and dropped, so
    every step's batch has signal; rows of signal groups still form the batch."""
    adm = GroupAdmission(
        max_staleness=4,
        rows_per_step=4,
        max_consecutive_empty=3,
        stats=LoopStats(),
        state=RolloutState("h"),
        drop_no_signal=True,
    )
    for i in range(5):  # more no-signal groups in a row than max_consecutive_empty: no abort
        assert adm.offer(_correct_group(i, [0.0, 0.0]), policy_version=0) is None
    assert adm.offer(_correct_group(5, [1.0, 1.0]), policy_version=0) is None
    assert adm.stats.dropped_no_signal == 6 and adm.state.counters["no_signal"] == 6
    assert adm.dropped == {"opencode": 6}  # logged per harness with the next step
    assert adm.offer(_correct_group(6, [1.0, 0.0]), policy_version=0) is None
    batch = adm.offer(_correct_group(7, [0.0, 1.0]), policy_version=0)
    assert batch is not None and [g.planned.group_id for g in batch] == ["g6", "g7"]
    assert all(abs(r.advantage) > 0.5 for r in _stamp_rows(batch, "group"))


def test_dynamic_sampling_step_is_cut_short_after_max_groups_with_signal_at_hand() -> None:
    """A policy that always solves or always fails its tasks gives groups without signal forever:
    with ``max_groups_per_step`` the step trains on the signal it has instead of waiting."""
    stats = LoopStats()
    adm = GroupAdmission(
        max_staleness=4, rows_per_step=8, max_consecutive_empty=3, stats=stats, state=RolloutState("h"),
        drop_no_signal=True, max_groups_per_step=5,
    )  # fmt: skip
    assert adm.offer(_group(0, [1.0, 0.0]), 0) is None  # 2 of 8 rows
    for i in range(1, 4):
        assert adm.offer(_group(i, [1.0, 1.0]), 0) is None  # all-correct: dropped, drawn 4
    batch = adm.offer(_group(4, [0.0, 0.0]), 0)  # the 5th group drawn: cut short
    assert batch is not None and [g.planned.group_id for g in batch] == ["g0"]
    assert stats.short_steps == 1 and stats.dropped_no_signal == 4 and adm.pending == []
    # The count restarts with the next step; without signal at hand it keeps drawing.
    for i in range(5, 12):
        assert adm.offer(_group(i, [1.0, 1.0]), 0) is None
    assert stats.short_steps == 1
    late = adm.offer(_group(12, [0.0, 1.0]), 0)  # the first group with signal ends the long step
    assert late is not None and [g.planned.group_id for g in late] == ["g12"] and stats.short_steps == 2
    uncapped = _admission(rows_per_step=8)
    uncapped.drop_no_signal = True
    assert uncapped.offer(_group(0, [1.0, 0.0]), 0) is None
    assert all(uncapped.offer(_group(i, [1.0, 1.0]), 0) is None for i in range(1, 50))


def test_dynamic_sampling_stops_the_run_after_patience_groups_without_signal() -> None:
    """No step can form once every group's rewards are equal, cap or not: ``no_signal_patience``
    such groups in a row end the run with an error that says how they ended; a signal group resets
    the count, and None draws on."""
    stats = LoopStats()
    adm = GroupAdmission(
        max_staleness=4, rows_per_step=8, max_consecutive_empty=3, stats=stats, state=RolloutState("h"),
        drop_no_signal=True, max_groups_per_step=2, no_signal_patience=5,
    )  # fmt: skip
    for i in range(4):
        assert adm.offer(_group(i, [1.0, 1.0]), 0) is None
    assert adm.offer(_group(4, [0.0, 1.0]), 0) is not None  # signal at hand after the cap: a short step
    for i in range(5, 8):
        assert adm.offer(_correct_group(i, [1.0, 1.0]), 0) is None
    assert adm.offer(_group(8, [0.0, 0.0]), 0) is None  # 4 in a row since the signal group
    with pytest.raises(RunAborted) as err:
        adm.offer(_group(9, [0.0, 0.0]), 0)
    msg = str(err.value)
    assert "5 groups in a row had no learning signal (3 all-correct, 2 all-zero)" in msg
    assert "trainer.dynamic_sampling_patience=null" in msg and "resumes" in msg
    patient = _admission(rows_per_step=8)
    patient.drop_no_signal = True  # no_signal_patience None: draws on
    assert all(patient.offer(_group(i, [1.0, 1.0]), 0) is None for i in range(300))


def test_no_signal_groups_never_abort_without_dynamic_sampling() -> None:
    """Without dynamic sampling such groups train with advantage 0, so steps still form."""
    stats = LoopStats()
    adm = GroupAdmission(
        max_staleness=4, rows_per_step=4, max_consecutive_empty=3, stats=stats, state=RolloutState("h"),
        no_signal_patience=2,
    )  # fmt: skip
    batches = [adm.offer(_group(i, [1.0, 1.0]), 0) for i in range(6)]
    assert sum(b is not None for b in batches) == 3 and stats.no_signal == 6
