"""The attempt guard: the agent's exit status passes through, and its whole tree dies with the run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

from fineenvs.harnesses import guard, sandbox


def _alive_marked(marker: str) -> list[int]:
    return guard._marked(marker)


def _until(check, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


def test_the_guard_and_the_sandbox_name_the_same_marker() -> None:
    assert guard.MARKER_ENV == sandbox.MARKER_ENV
    assert sandbox.GUARD.is_file() and sandbox.GUARD == Path(guard.__file__)


def test_exit_status_passes_through() -> None:
    marker = uuid.uuid4().hex
    env = dict(os.environ, **{guard.MARKER_ENV: marker})
    code = subprocess.run(sandbox.guarded(["sh", "-c", "exit 3"], marker), env=env).returncode
    assert code == 3
    killed = subprocess.run(sandbox.guarded(["sh", "-c", "kill -KILL $$"], marker), env=env).returncode
    assert killed == -signal.SIGKILL
    missing = subprocess.run(sandbox.guarded(["/nonexistent/agent"], marker), env=env, capture_output=True)
    assert missing.returncode == 127 and b"could not start" in missing.stderr


def test_a_sigkilled_run_takes_its_agents_tree_down(tmp_path: Path) -> None:
    """The run (here a stand-in parent) is SIGKILLed while its agent runs a shell that started a
    server in a session of its own: both go within seconds."""
    marker = uuid.uuid4().hex
    pids = tmp_path / "pids"
    agent = f"setsid sleep 300 & echo $! > {pids}; sleep 300"
    parent = textwrap.dedent(
        f"""
        import os, subprocess, sys, time
        sys.path.insert(0, {str(Path(sandbox.__file__).parents[2])!r})
        from fineenvs.harnesses.sandbox import guarded
        env = dict(os.environ, {guard.MARKER_ENV}={marker!r})
        subprocess.Popen(guarded(["sh", "-c", {agent!r}], {marker!r}), env=env, start_new_session=True)
        time.sleep(300)
        """
    )
    run = subprocess.Popen([sys.executable, "-c", parent])
    try:
        assert _until(lambda: pids.is_file() and pids.read_text().strip() and len(_alive_marked(marker)) >= 3)
        server = int(pids.read_text())
        assert server in _alive_marked(marker)
    finally:
        run.send_signal(signal.SIGKILL)
        run.wait()
    assert _until(lambda: not _alive_marked(marker), timeout=10), _alive_marked(marker)


def test_sigterm_to_the_guard_stops_the_agent_and_what_it_left(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    env = dict(os.environ, **{guard.MARKER_ENV: marker})
    # An agent that ignores SIGTERM: the guard escalates to SIGKILL after its grace.
    proc = subprocess.Popen(
        sandbox.guarded(["sh", "-c", "trap '' TERM; sleep 300 & sleep 300"], marker),
        env=env,
        start_new_session=True,
    )
    assert _until(lambda: len(_alive_marked(marker)) >= 3)
    started = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=15) == 128 + signal.SIGTERM
    assert time.monotonic() - started < guard.GRACE_SECONDS + 5
    assert _until(lambda: not _alive_marked(marker), timeout=5)
