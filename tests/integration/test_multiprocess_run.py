"""Under ``accelerate launch`` with two processes (DDP over gloo on CPU) the smoke run starts one
engine, one proxy and one set of agents, pushes weights once per step, and the second process
replays every collective trainer call (steps, the state-dict gathers of the pushes, checkpoints)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from fineenvs.harnesses import check_installed
from fineenvs.paths import REPO_ROOT

pytestmark = pytest.mark.slow


def test_only_the_main_process_runs_rollouts(tmp_path: Path) -> None:
    problems = check_installed(["mini_swe_agent"])
    if problems:
        pytest.fail("the smoke run needs its agent CLI: " + "; ".join(problems))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(port), "-m", "fineenvs.run", "+experiment=smoke", f"hydra.run.dir={out}",
    ]  # fmt: skip
    env = dict(os.environ, ACCELERATE_USE_CPU="true", WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=1500)
    text = res.stdout + res.stderr
    assert res.returncode == 0, text[-5000:]
    assert text.count("Built engine") == 1 and text.count("Built proxy") == 1, "one engine and one proxy"
    # 2 steps + 2 pushes (state-dict gathers) + 2 checkpoints + 3 parity-gate forwards (before the
    # first step and after each push), replayed in lockstep by process 1.
    assert "process 1 replayed 9 trainer calls" in text
    engine_log = (out / "engine" / "engine.log").read_text()
    assert engine_log.count("$ ") == 1, "the engine was started once"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["weight_pushes"] == 2 and summary["attempts"] >= 4
    assert summary["parity_checks"] == 3, "the gate ran on the main process; process 1 replayed it"
    attempts = [json.loads(line) for line in (out / "attempts.jsonl").read_text().splitlines()]
    assert len(attempts) == summary["attempts"], "attempts were written by one process only"
    assert abs(summary["last_ratio"] - 1.0) < 1e-3
