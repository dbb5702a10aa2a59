"""The CPU smoke run end to end (real engine, proxy, agent CLI, trainer), and kill-and-resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fineenvs.harnesses import check_installed
from fineenvs.paths import REPO_ROOT

pytestmark = pytest.mark.slow


def _cmd(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "fineenvs.run", "+experiment=smoke", f"hydra.run.dir={out}", *extra]


def _env() -> dict[str, str]:
    return dict(os.environ, WANDB_MODE="disabled", PYTHONUNBUFFERED="1")


@pytest.fixture(autouse=True)
def _needs_agent() -> None:
    problems = check_installed(["mini_swe_agent"])
    if problems:
        pytest.fail("the smoke run needs its agent CLI: " + "; ".join(problems))


def _attempt_groups(out: Path) -> list[str]:
    path = out / "attempts.jsonl"
    return [json.loads(line)["group_id"] for line in path.read_text().splitlines()] if path.exists() else []


def test_smoke_run_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "smoke"
    res = subprocess.run(_cmd(out), capture_output=True, text=True, cwd=REPO_ROOT, env=_env(), timeout=1200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["weight_pushes"] == 2
    assert summary["rows_trained"] > 0 and summary["attempts"] >= 4
    assert abs(summary["last_ratio"] - 1.0) < 1e-3
    assert "fineenvs run summary" in res.stdout
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first = metrics[0]
    # On-policy at step 0: the trainer's recomputed logprobs equal the engine's behaviour logprobs.
    assert abs(first["train/ratio"] - 1.0) <= 1e-4, first["train/ratio"]
    assert first["train/policy_version"] == 1.0
    assert (out / "checkpoints" / "step-2" / "COMPLETE").exists()
    # The in-training evaluation hook ran at step 2 (trainer.eval_steps) on the held-out split.
    results = json.loads((out / "eval" / "results.json").read_text())
    assert "step-2" in results["pass_at_1"], results.keys()
    assert any("eval/pass_at_1" in m for m in metrics)
    # Every recorded call carries the engine's token ids; weight versions advance across steps.
    records = list((out / "records").rglob("*.jsonl"))
    assert records, "the proxy recorded no calls"


def test_killed_run_resumes_without_replaying_groups(tmp_path: Path) -> None:
    out = tmp_path / "resume"
    proc = subprocess.Popen(
        _cmd(out, "trainer.max_steps=3"),
        cwd=REPO_ROOT,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    marker = out / "checkpoints" / "step-1" / "COMPLETE"
    deadline = time.monotonic() + 900
    try:
        while not marker.exists():
            assert proc.poll() is None, "the run ended before its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint within 15 minutes"
            time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    trained = json.loads((out / "checkpoints" / "step-1" / "rollout_state.json").read_text())["consumed"]
    assert trained, "step 1 trained on at least one group"
    before = len(_attempt_groups(out))
    res = subprocess.run(
        _cmd(out, "trainer.max_steps=3"),
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=_env(),
        timeout=1200,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "Resumed from" in res.stdout
    replayed = set(_attempt_groups(out)[before:]) & set(trained)
    assert not replayed, f"groups trained before the kill were run again: {replayed}"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3
