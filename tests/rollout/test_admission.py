from __future__ import annotations

from types import SimpleNamespace

import pytest

from fineenvs.rl import GroupAdmission, LoopStats, RunAborted, _stamp_rows
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
