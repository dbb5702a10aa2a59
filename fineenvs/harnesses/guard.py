"""An attempt's guard: the agent's parent, which takes the agent's whole process tree down with it.

``python -I guard.py <run pid> <marker> -- <agent argv...>`` (run by path, standard library only,
so it starts in milliseconds and imports nothing of the project).

Why. An agent runs in its own session so that its shells and servers can be killed as one group,
which also means nothing ties it to the run: when the run is SIGKILLed (the OOM killer, a cluster
time limit that escalates) its agents kept running with PPID 1. The guard asks the kernel for a
SIGTERM when its parent dies (``PR_SET_PDEATHSIG``), starts the agent in a process group of its
own, and on SIGTERM (the run died, or the run is stopping the attempt) kills that group and every
process carrying the attempt's marker in its environment (descendants that left the group), first
with SIGTERM, then SIGKILL. Otherwise it waits for the agent and exits as the agent did (the same
exit code, or the same signal), so the caller sees the agent's own status. When the agent is a
``docker run`` client (the docker sandbox), stopping also removes its container, found by the
attempt's label with the client's absolute path (see :func:`_remove_container`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time

MARKER_ENV = "FINEENVS_ATTEMPT_ID"  # every process of an attempt carries it (the sandbox sets it)
RUN_MARKER_ENV = "FINEENVS_RUN_DIR"  # every process of a run: its output directory (fineenvs.lifecycle)
CONTAINER_ENV = "FINEENVS_CONTAINER"  # the attempt's container, where it runs in one (container.py)
DOCKER_CLIENT_ENV = "FINEENVS_DOCKER"  # the docker client's absolute path, resolved at attempt start
ATTEMPT_LABEL = "fineenvs.attempt"  # the label with the attempt's marker on its container (container.py)
GRACE_SECONDS = 3.0
CONTAINER_SETTLE_SECONDS = 1.0  # no container of the attempt for this long: none is being created
REMOVE_DEADLINE_SECONDS = 15.0


def pids_with_env(name: str, value: str, skip: set[int]) -> list[int]:
    """Live processes whose environment has ``name=value`` (children inherit it), minus ``skip``."""
    needle = f"{name}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in skip:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0") and alive(int(entry)):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def alive(pid: int) -> bool:
    """Running (not a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _marked(marker: str) -> list[int]:
    return pids_with_env(MARKER_ENV, marker, {os.getpid()})


def _take_down(agent: subprocess.Popen[bytes], marker: str) -> None:
    for sig, wait in ((signal.SIGTERM, GRACE_SECONDS), (signal.SIGKILL, 2.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(agent.pid, sig)
        for pid in _marked(marker):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            agent.poll()  # reap the agent itself, or it stays a zombie that looks alive
            if not alive(agent.pid) and not _marked(marker):
                return
            time.sleep(0.05)


def _docker_out(docker: str, *args: str) -> str | None:
    """stdout of ``docker args``, None where the client failed (no daemon, a timeout)."""
    try:
        done = subprocess.run([docker, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _remove_container(marker: str, *, settle: float = CONTAINER_SETTLE_SECONDS) -> None:
    """Remove the attempt's container (the docker sandbox tells us, in our environment, the client's
    absolute path: our PATH is the agent's, which may not hold it). Killing the ``docker run`` client
    does not stop its container, and the run may be gone already.

    By the attempt's label, not by name, and until no such container has shown up for ``settle``
    seconds: a client killed while the daemon was still creating the container leaves one that
    appears only after the kill, and a one-shot ``docker rm`` of the name would miss it."""
    docker = os.environ.get(DOCKER_CLIENT_ENV)
    if not os.environ.get(CONTAINER_ENV) or not docker:
        return
    query = ("ps", "-aq", "--no-trunc", "--filter", f"label={ATTEMPT_LABEL}={marker}")
    deadline = time.monotonic() + REMOVE_DEADLINE_SECONDS
    quiet_since = time.monotonic()
    while time.monotonic() < deadline:
        ids = _docker_out(docker, *query)
        if ids is None:  # the daemon is gone: its containers with it, nothing to wait for
            return
        if ids.split():
            _docker_out(docker, "rm", "-f", *ids.split())
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= settle:
            return
        time.sleep(0.2)


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print("usage: guard.py <run pid> <marker> -- <argv...>", file=sys.stderr)
        return 2
    run_pid, marker, command = int(argv[0]), argv[1], argv[3:]
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != run_pid:  # the run died before the line above took effect
        return 128 + signal.SIGTERM
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(signum))
    try:
        agent = subprocess.Popen(command, process_group=0)
    except OSError as exc:
        print(f"could not start {command[0]}: {exc}", file=sys.stderr)
        return 127
    while agent.poll() is None and not stopping:
        # A short timeout, not a signal-interrupted wait: the handler above only sets a flag.
        with contextlib.suppress(subprocess.TimeoutExpired):
            agent.wait(timeout=0.2)
    if stopping:
        _take_down(agent, marker)
        _remove_container(marker)
        return 128 + signal.SIGTERM
    _take_down(agent, marker)  # the agent exited: its leftovers (shells, servers) go too
    code = agent.returncode
    if code < 0:  # die of the agent's signal, so the caller sees exactly what the agent did
        with contextlib.suppress(OSError, ValueError):  # SIGKILL has no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
