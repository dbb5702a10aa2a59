"""``+experiment=eval`` end to end on CPU: tiny model, embedded engine, proxy, mini-swe-agent, two
checkpoints (the base model and a checkpoint directory), results.json, resume without re-running."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fineenvs.harnesses import check_installed
from fineenvs.paths import REPO_ROOT
from fineenvs.proxy.store import CallStore
from fineenvs.trajectory.record import CallRecord

pytestmark = pytest.mark.slow


def _cmd(out: Path, ckpt: Path) -> list[str]:
    return [
        sys.executable, "-m", "fineenvs.run", "+experiment=eval",
        "model=tiny_qwen", "engine=transformers", "tasks=demo", "harness=mini_swe_agent", "logger=none",
        "eval.limit=2", f"eval.checkpoints=[base,{ckpt}]",
        "sampling.max_tokens=48", "scheduler.max_model_calls=3", "scheduler.attempt_timeout_seconds=120",
        f"hydra.run.dir={out}",
    ]  # fmt: skip


def test_eval_two_checkpoints_end_to_end_and_resume(tmp_path: Path, tiny_qwen_dir: Path) -> None:
    problems = check_installed(["mini_swe_agent"])
    if problems:
        pytest.fail("the eval run needs its agent CLI: " + "; ".join(problems))
    ckpt = tmp_path / "step-1"
    shutil.copytree(tiny_qwen_dir, ckpt)  # a model directory, as a trainer checkpoint is
    out = tmp_path / "eval_run"
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    res = subprocess.run(_cmd(out, ckpt), capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]

    results = json.loads((out / "eval" / "results.json").read_text())
    assert results["checkpoints"] == ["tiny_qwen", str(ckpt)] and results["baseline"] == "tiny_qwen"
    assert results["harnesses"] == ["mini_swe_agent"] and results["tasks"] == 2 and results["split"] == "test"
    # A random-initialised model never answers correctly.
    assert results["pass_at_1"] == {"tiny_qwen": {"mini_swe_agent": 0.0}, str(ckpt): {"mini_swe_agent": 0.0}}
    assert results["overall"] == {"tiny_qwen": 0.0, str(ckpt): 0.0}
    for c in results["checkpoints"]:
        cell = results["cells"][c]["mini_swe_agent"]
        assert cell["tasks"] == 2 and cell["graded"] + cell["ungraded"] == 2 and cell["solved"] == 0
        assert cell["attempts"] >= 2
        if cell["graded"]:
            # Tokens come from the proxy's records: the engine's own token ids.
            assert cell["prompt_tokens"] > 0 and cell["completion_tokens"] > 0
    assert "pass@1 on 2 test tasks" in res.stdout and "overall" in res.stdout
    attempts = [json.loads(line) for line in (out / "eval" / "attempts.jsonl").read_text().splitlines()]
    assert {a["task_id"] for a in attempts} == {
        a["task_id"] for a in attempts if a["checkpoint"] == "tiny_qwen"
    } and len({a["task_id"] for a in attempts}) == 2
    # Each checkpoint had its own engine and proxy; the agent wrote its attempt folders there.
    assert len(list((out / "eval").glob("*/proxy.log"))) == 2
    assert len(list((out / "eval").glob("*/attempts/*/*/attempt.json"))) == len(attempts)

    # Common random numbers (eval.common_random_numbers, the default): a cell's i-th call gets the
    # same engine seed under both checkpoints, so the same weights sample the same tokens there.
    first_calls: dict[str, dict[str, CallRecord]] = {}
    for meta_file in (out / "eval").glob("*/records/sessions/*/meta.json"):
        meta = json.loads(meta_file.read_text())
        store = CallStore(meta_file.parents[2])
        calls = store.read_session(meta["session_id"])["calls"]
        store.close()
        if calls and meta["metadata"]["attempt"].endswith("-try0"):
            first_calls.setdefault(meta["metadata"]["task"], {})[str(meta_file.parents[3])] = calls[0]
    pairs = [list(by_ckpt.values()) for by_ckpt in first_calls.values() if len(by_ckpt) == 2]
    assert pairs, f"no cell with a first call under both checkpoints: {first_calls}"
    for a, b in pairs:
        assert a["sampling_applied"]["seed"] == b["sampling_applied"]["seed"]
        assert a["prompt_ids"] == b["prompt_ids"] and a["sampled_ids"] == b["sampled_ids"]
    seeds = [a["sampling_applied"]["seed"] for a, _ in pairs]
    assert len(set(seeds)) == len(seeds)  # cells draw unrelated numbers

    # Same output directory again: graded cells are skipped, no engine starts.
    graded = {(a["checkpoint"], a["task_id"]) for a in attempts if a["reward"] is not None}
    again = subprocess.run(
        _cmd(out, ckpt), capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=900
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    if len(graded) == 4:
        assert again.stdout.count("already graded") == 2 and "engine transformers" not in again.stdout
        after = (out / "eval" / "attempts.jsonl").read_text().splitlines()
        assert len(after) == len(attempts)
