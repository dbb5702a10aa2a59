"""Stopping a run: a restart reaps what a killed run left; SIGTERM stops attempts as Ctrl-C does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from fineenvs.lifecycle import RUN_MARKER_ENV, reap_leftovers, run_processes
from fineenvs.paths import REPO_ROOT


def _sleeper(run_dir: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, **{RUN_MARKER_ENV: str(run_dir.resolve())})
    # Ignores SIGTERM, like a wedged server: the reaper must escalate.
    return subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 300"], env=env, start_new_session=True)


def test_a_restart_reaps_only_its_own_directorys_leftovers(tmp_path: Path) -> None:
    mine, other = tmp_path / "run", tmp_path / "other"
    left, unrelated = _sleeper(mine), _sleeper(other)
    try:
        deadline = time.monotonic() + 10
        while left.pid not in run_processes(mine) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert left.pid in run_processes(mine)  # the shell (and its sleep)
        reaped = reap_leftovers(mine, grace_s=1.0)
        assert left.pid in reaped
        assert left.wait(timeout=5) == -signal.SIGKILL
        assert run_processes(mine) == []
        assert unrelated.poll() is None and unrelated.pid in run_processes(other)
    finally:
        for p in (left, unrelated):
            p.kill()
            p.wait()


def test_sigterm_stops_running_attempts_and_records_the_stop(tmp_path: Path) -> None:
    """A process that runs an attempt through the real sandbox (a shell agent that would run for
    five minutes) and gets SIGTERM: the attempt ends at once, the stop is recorded, exit 143."""
    out = tmp_path / "run"
    script = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        from fineenvs.harnesses.sandbox import guarded, stop_live_attempts, _LIVE, _LIVE_LOCK
        from fineenvs.lifecycle import mark_run, stop_on_signals
        import subprocess, os, uuid
        out = Path({str(out)!r})
        mark_run(out)
        stop_on_signals(out)
        marker = uuid.uuid4().hex
        env = dict(os.environ, FINEENVS_ATTEMPT_ID=marker)
        proc = subprocess.Popen(guarded(["sh", "-c", "sleep 300 & sleep 300"], marker), env=env, start_new_session=True)
        with _LIVE_LOCK:
            _LIVE[proc.pid] = marker
        print("started", flush=True)
        try:
            proc.wait()
        except KeyboardInterrupt:
            print("agent exited", proc.wait(timeout=20), flush=True)
            raise SystemExit(143)
        """
    )
    run = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    assert run.stdout is not None
    assert run.stdout.readline().strip() == "started"
    deadline = time.monotonic() + 10
    while len(run_processes(out)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(run_processes(out)) >= 3  # the run, the guard, the shell, the sleeps
    run.send_signal(signal.SIGTERM)
    assert run.wait(timeout=30) == 143
    assert f"agent exited {128 + signal.SIGTERM}" in run.stdout.read()
    stopped = json.loads((out / "stopped.json").read_text())
    assert stopped["signal"] == "SIGTERM" and stopped["attempts_cut_off"] == 1
    deadline = time.monotonic() + 10
    while run_processes(out) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert run_processes(out) == []
