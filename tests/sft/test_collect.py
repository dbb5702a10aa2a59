"""Teacher collection logic without agents: attempts in order, first correct kept, manifest, job guards."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from fineenvs.jobs.errors import CollectionAborted
from fineenvs.jobs.teacher import (
    PAIRS_LOG,
    TEACHER_MANIFEST,
    PairResult,
    _pair_record,
    collect_pairs,
    is_correct,
    pending_pairs,
    teacher_pairs,
    write_teacher_manifest,
)
from fineenvs.rollout.schedule import PlannedGroup
from fineenvs.rollout.scheduler import AttemptOutcome


def _outcome(group: PlannedGroup, index: int, correct: float | None) -> AttemptOutcome:
    return AttemptOutcome(
        attempt_id=group.attempt_ids[index],
        group_id=group.group_id,
        task_id=group.task_id,
        harness=group.harness,
        policy_version=0,
        reward=correct,
        reward_terms={"correctness": correct},
    )


def test_pairs_cover_every_task_and_harness_in_order() -> None:
    groups = teacher_pairs(["a", "b"], ["opencode", "codex"], 3)
    assert [(g.task_id, g.harness) for g in groups] == [
        ("a", "opencode"),
        ("a", "codex"),
        ("b", "opencode"),
        ("b", "codex"),
    ]
    assert groups[3].attempt_ids == (
        "teacher-t00001-codex-a0",
        "teacher-t00001-codex-a1",
        "teacher-t00001-codex-a2",
    )
    with pytest.raises(ValueError, match="attempts_per_task must be >= 1, got 0"):
        teacher_pairs(["a"], ["opencode"], 0)


def test_is_correct_needs_a_full_grade() -> None:
    g = teacher_pairs(["a"], ["opencode"], 1)[0]
    assert is_correct(_outcome(g, 0, 1.0))
    assert not is_correct(_outcome(g, 0, 0.0))
    assert not is_correct(_outcome(g, 0, 0.5))
    assert not is_correct(_outcome(g, 0, None))


def test_first_correct_attempt_is_kept_and_the_pair_stops() -> None:
    # task -> grade of each attempt; "boom" raises inside the runner.
    script: dict[str, list[object]] = {
        "first": [1.0, 1.0, 1.0],
        "second": [0.0, 1.0, 1.0],
        "never": [0.0, None, 0.0],
        "crash": ["boom", 1.0, 0.0],
    }
    calls: list[str] = []
    inflight = [0, 0]

    async def runner(group: PlannedGroup, index: int, version: int) -> AttemptOutcome:
        calls.append(group.attempt_ids[index])
        inflight[0] += 1
        inflight[1] = max(inflight[1], inflight[0])
        await asyncio.sleep(0.01)
        inflight[0] -= 1
        grade = script[group.task_id][index]
        if grade == "boom":
            raise RuntimeError("agent exploded")
        assert grade is None or isinstance(grade, float)
        return _outcome(group, index, grade)

    groups = teacher_pairs(list(script), ["opencode"], 3)
    seen: list[str] = []
    pairs: list[str] = []
    results = asyncio.run(
        collect_pairs(
            groups,
            runner,
            max_inflight=2,
            on_attempt=lambda a: seen.append(a.attempt_id),
            on_pair=lambda p: pairs.append(p.group.task_id),
        )
    )
    by_task = {r.group.task_id: r for r in results}
    assert [len(by_task[t].attempts) for t in script] == [1, 2, 3, 2]
    assert by_task["first"].kept is not None and by_task["first"].kept.attempt_id.endswith("-a0")
    assert by_task["second"].kept is not None and by_task["second"].kept.attempt_id.endswith("-a1")
    assert by_task["never"].kept is None
    # An ungraded attempt leaves the pair open for a rerun; a correct or fully graded one settles it.
    assert [by_task[t].settled for t in script] == [True, True, False, True]
    crashed = by_task["crash"].attempts[0]
    assert crashed.exit_reason == "crashed" and "agent exploded" in str(crashed.error)
    assert by_task["crash"].kept is not None and by_task["crash"].kept.attempt_id.endswith("-a1")
    assert sorted(seen) == sorted(calls) and len(calls) == 8
    assert sorted(pairs) == sorted(script)
    assert inflight[1] <= 2


def test_collection_stops_after_too_many_ungraded_attempts() -> None:
    calls: list[str] = []

    async def runner(group: PlannedGroup, index: int, version: int) -> AttemptOutcome:
        calls.append(group.attempt_ids[index])
        raise ConnectionError("proxy is gone")

    logged: list[PairResult] = []
    groups = teacher_pairs(["a", "b", "c"], ["opencode"], 3)
    with pytest.raises(
        CollectionAborted, match=r"3 attempts in a row were ungraded \(attempt exits so far: crashed=3\)"
    ):
        asyncio.run(
            collect_pairs(groups, runner, max_inflight=1, on_pair=logged.append, max_consecutive_ungraded=3)
        )
    assert calls == ["teacher-t00000-opencode-a0", "teacher-t00000-opencode-a1", "teacher-t00000-opencode-a2"]
    assert [len(p.attempts) for p in logged] == [3, 0, 0] and not any(p.settled for p in logged)


def _write_meta(store: Path, sid: str, attempt: str, created: float) -> None:
    d = store / "sessions" / sid
    d.mkdir(parents=True)
    (d / "meta.json").write_text(
        json.dumps({"session_id": sid, "metadata": {"attempt": attempt}, "created_at": created})
    )


def test_manifest_lists_kept_sessions_and_summary(tmp_path: Path) -> None:
    store = tmp_path / "records"
    groups = teacher_pairs(["t1", "t2"], ["opencode", "codex"], 2)
    results = []
    for g, grades in zip(groups, [[1.0], [0.0, 1.0], [0.0, 0.0], [1.0]], strict=True):
        results.append(PairResult(g, [_outcome(g, i, x) for i, x in enumerate(grades)]))
    with (tmp_path / PAIRS_LOG).open("w") as f:
        for r in results:
            f.write(json.dumps(_pair_record(r, tmp_path / "attempts")) + "\n")
    _write_meta(store, "sA", "teacher-t00000-opencode-a0", 1.0)
    _write_meta(store, "sOld", "teacher-t00000-codex-a1", 1.0)
    _write_meta(store, "sB", "teacher-t00000-codex-a1", 2.0)  # a rerun of the same attempt: newest wins
    _write_meta(store, "sC", "teacher-t00001-codex-a0", 3.0)
    _write_meta(store, "sX", "teacher-t00001-opencode-a0", 3.0)  # a failed attempt: not listed
    summary = write_teacher_manifest(tmp_path, store, "Qwen/Qwen3.8-27B")
    manifest = json.loads((tmp_path / TEACHER_MANIFEST).read_text())
    assert [(s["task"], s["harness"], s["session_id"]) for s in manifest["sessions"]] == [
        ("t1", "opencode", "sA"),
        ("t1", "codex", "sB"),
        ("t2", "codex", "sC"),
    ]
    assert manifest["sessions"][1]["attempt_dir"].endswith(
        "attempts/teacher-t00000-codex/teacher-t00000-codex-a1"
    )
    assert summary["kept_rollouts"] == 3 and summary["tasks_with_kept_rollout"] == 2
    assert summary["tasks_tried"] == 2 and summary["pairs_tried"] == 4 and summary["attempts"] == 6
    assert summary["per_harness"]["opencode"] == {
        "tasks_tried": 2,
        "correct": 1,
        "attempts": 3,
        "solve_rate": 0.5,
    }
    assert summary["per_harness"]["codex"]["correct"] == 2


def test_sft_job_needs_a_teacher_dir(tmp_path: Path) -> None:
    from hydra import compose, initialize_config_dir

    from fineenvs.config import ConfigError, to_run_config
    from fineenvs.jobs.errors import RunAborted
    from fineenvs.jobs.sft import run_sft
    from fineenvs.paths import REPO_ROOT

    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=["+experiment=sft_opencode", f"output_dir={tmp_path}"])
        given = compose(
            "config",
            overrides=[
                "+experiment=sft_opencode",
                f"output_dir={tmp_path}",
                f"trainer.teacher_dir={tmp_path / 'nowhere'}",
            ],
        )
    with pytest.raises(ConfigError, match=r"trainer.teacher_dir=<output dir"):
        to_run_config(cfg)  # at compose time: dry_run=true shows it
    run = to_run_config(given)
    assert list(run.harness) == ["opencode"]
    with pytest.raises(RunAborted, match="collect_teacher"):
        run_sft(run)


def test_rerun_skips_settled_pairs_and_clears_open_ones(tmp_path: Path) -> None:
    groups = teacher_pairs(["a", "b", "c"], ["opencode"], 2)
    settled_ok = PairResult(groups[0], [_outcome(groups[0], 0, 1.0)])
    settled_wrong = PairResult(groups[1], [_outcome(groups[1], i, 0.0) for i in range(2)])
    open_pair = PairResult(groups[2], [_outcome(groups[2], 0, None)])
    with (tmp_path / PAIRS_LOG).open("w") as f:
        for r in (settled_ok, settled_wrong, open_pair):
            f.write(json.dumps(_pair_record(r, tmp_path / "attempts")) + "\n")
    stale = tmp_path / "attempts" / groups[2].group_id / groups[2].attempt_ids[0] / "work"
    stale.mkdir(parents=True)
    (stale / "answer.txt").write_text("old answer\n")
    kept_dir = tmp_path / "attempts" / groups[0].group_id
    kept_dir.mkdir(parents=True)
    assert [g.group_id for g in pending_pairs(groups, tmp_path)] == [groups[2].group_id]
    assert not (tmp_path / "attempts" / groups[2].group_id).exists() and kept_dir.exists()
    # The rerun's line for the open pair replaces its old one in the manifest's summary.
    rerun = PairResult(groups[2], [_outcome(groups[2], 0, 0.0), _outcome(groups[2], 1, 1.0)])
    with (tmp_path / PAIRS_LOG).open("a") as f:
        f.write(json.dumps(_pair_record(rerun, tmp_path / "attempts")) + "\n")
    summary = write_teacher_manifest(tmp_path, tmp_path / "records", "teacher")
    assert summary["pairs_tried"] == 3 and summary["attempts"] == 5
    assert pending_pairs(groups, tmp_path) == []
