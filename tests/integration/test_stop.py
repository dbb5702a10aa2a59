"""Nothing outlives a stopped run: SIGTERM or SIGKILL a real run while its agents work.

The CPU smoke run (embedded engine, capture proxy, Mini-SWE-Agent attempts, trainer) is stopped
while at least one agent is running. After SIGTERM the run stops every component in reverse,
records the stop and exits 143; after SIGKILL the engine, the proxy and every agent follow within
seconds (they are tied to the run by PR_SET_PDEATHSIG and the attempt guard). Either way no
process carrying the run's mark (``FINEENVS_RUN_DIR``) is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from fineenvs.harnesses import check_installed
from fineenvs.lifecycle import run_processes
from fineenvs.paths import REPO_ROOT
from tests.integration.runs import attempt_processes, smoke_command

pytestmark = pytest.mark.slow


def _start(out: Path) -> subprocess.Popen[bytes]:
    problems = check_installed(["mini_swe_agent"])
    assert not problems, "; ".join(problems)
    cmd = smoke_command(out, ["mini_swe_agent"], "trainer.max_steps=50")
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    log = (out.parent / f"{out.name}.log").open("wb")
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait_for_agents(run: subprocess.Popen[bytes], out: Path) -> None:
    deadline = time.monotonic() + 600
    while len(attempt_processes(out)) < 2:  # a guard and its agent at least
        assert run.poll() is None, "the run ended before an agent started: " + _log(out)
        assert time.monotonic() < deadline, "no agent started within 10 minutes"
        time.sleep(0.2)
    engine_and_proxy = [p for p in run_processes(out) if p not in attempt_processes(out)]
    assert len(engine_and_proxy) >= 2, "the engine and the proxy carry the run's mark too"


def _settled(out: Path, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while run_processes(out) and time.monotonic() < deadline:
        time.sleep(0.2)
    return run_processes(out)


def _log(out: Path) -> str:
    path = out.parent / f"{out.name}.log"
    return path.read_text(errors="replace")[-3000:] if path.is_file() else ""


def test_sigterm_stops_the_run_like_ctrl_c(tmp_path: Path) -> None:
    out = tmp_path / "term"
    run = _start(out)
    try:
        _wait_for_agents(run, out)
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=180) == 128 + signal.SIGTERM, _log(out)
    finally:
        if run.poll() is None:
            run.kill()
    left = _settled(out, timeout=15)
    assert not left, f"processes of the stopped run still alive: {left}"
    stopped = json.loads((out / "stopped.json").read_text())
    assert stopped["signal"] == "SIGTERM" and stopped["attempts_cut_off"] >= 1
    assert "stopped by SIGTERM" in _log(out)


def test_sigkill_leaves_nothing_behind(tmp_path: Path) -> None:
    out = tmp_path / "kill"
    run = _start(out)
    try:
        _wait_for_agents(run, out)
        agents = attempt_processes(out)
    finally:
        run.send_signal(signal.SIGKILL)  # the run alone, as the OOM killer would
        run.wait(timeout=60)
    left = _settled(out, timeout=20)
    assert not left, f"processes of the SIGKILLed run still alive (agents were {agents}): {left}"
