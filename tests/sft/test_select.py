"""Which teacher rollouts ``job=sft`` trains on: ``trainer.rollout_slices`` and ``max_rollouts_per_harness``."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest

from fineenvs.jobs.errors import RunAborted
from fineenvs.jobs.sft import select_rollouts
from fineenvs.train.sft_config import SFTSettings


@dataclass
class _Session:
    task_id: str
    harness: str


def _collection() -> list[_Session]:
    sessions = [_Session(f"mini-train-{i:03d}", "pi") for i in range(10)]
    sessions += [_Session(f"mini-train-{i:03d}", "opencode") for i in range(6)]
    random.Random(0).shuffle(sessions)  # a manifest's order is the order attempts finished
    return sessions


def _ids(sessions: list[_Session], harness: str) -> list[int]:
    return [int(s.task_id.rsplit("-", 1)[1]) for s in sessions if s.harness == harness]


def test_slices_count_in_task_order_per_harness_and_split_a_collection() -> None:
    sessions = _collection()
    assert select_rollouts(sessions, SFTSettings()) is sessions
    base = select_rollouts(sessions, SFTSettings(rollout_slices={"pi": [0, 8], "opencode": [0, 3]}))
    rest = select_rollouts(sessions, SFTSettings(rollout_slices={"pi": [8, 10], "opencode": [3, 6]}))
    assert _ids(base, "pi") == list(range(8)) and _ids(base, "opencode") == [0, 1, 2]
    assert _ids(rest, "pi") == [8, 9] and _ids(rest, "opencode") == [3, 4, 5]
    tail = select_rollouts(sessions, SFTSettings(rollout_slices={"pi": [7]}))  # [start]: to the end
    assert _ids(tail, "pi") == [7, 8, 9] and _ids(tail, "opencode") == list(range(6))
    # A harness not named keeps all; the cap applies after the slice.
    capped = select_rollouts(
        sessions, SFTSettings(rollout_slices={"pi": [4, 10]}, max_rollouts_per_harness=3)
    )
    assert _ids(capped, "pi") == [4, 5, 6] and _ids(capped, "opencode") == [0, 1, 2]


def test_a_slice_past_the_collection_is_refused_with_the_fix() -> None:
    sessions = _collection()
    with pytest.raises(
        RunAborted, match=r"opencode rollouts up to #12, but the collection .* kept 6.*tasks.limit=12"
    ):
        select_rollouts(sessions, SFTSettings(rollout_slices={"opencode": [6, 12]}))
    with pytest.raises(RunAborted, match="kept 0"):
        select_rollouts(sessions, SFTSettings(rollout_slices={"mini_swe_agent": [0, 1]}))
    with pytest.raises(RunAborted, match="up to #11, but .* kept 10"):
        select_rollouts(sessions, SFTSettings(rollout_slices={"pi": [10]}))


def test_the_dry_run_reports_what_the_collection_lacks(tmp_path: Path) -> None:
    """``dry_run=true`` (the preflight) checks the teacher collection the SFT job will read: its
    manifest, and what ``trainer.rollout_slices`` asks of it; the job checks the same."""
    import json

    from hydra import compose, initialize_config_dir

    from fineenvs.config import to_run_config
    from fineenvs.paths import CONF_DIR
    from fineenvs.plan import TEACHER_MANIFEST, preflight

    def plan_problems(*overrides: str) -> list[str]:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(
                "config", overrides=["+experiment=sft_opencode", f"output_dir={tmp_path / 'out'}", *overrides]
            )
        return [p for p in preflight(to_run_config(cfg)) if "teacher" in p or "rollout" in p]

    collection = tmp_path / "teacher"
    assert any(
        "teacher_manifest.json does not exist" in p
        for p in plan_problems(f"trainer.teacher_dir={collection}")
    )
    collection.mkdir()
    sessions = [{"harness": "opencode", "task": f"t{i}", "session_id": f"s{i}"} for i in range(6)]
    (collection / TEACHER_MANIFEST).write_text(json.dumps({"sessions": sessions}))
    assert plan_problems(f"trainer.teacher_dir={collection}") == []
    (problem,) = plan_problems(f"trainer.teacher_dir={collection}", "+trainer.rollout_slices.opencode=[0,12]")
    assert "opencode rollouts up to #12, but the collection" in problem and "kept 6" in problem
