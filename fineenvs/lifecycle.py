"""Nothing outlives a run: SIGTERM stops it as Ctrl-C does, and a restart reaps what a kill left.

- ``mark_run(out)`` puts the run's output directory in the environment (``FINEENVS_RUN_DIR``):
  every child inherits it (engine, proxy, the stages of ``recipe=mini_repro``) and the sandbox gives
  it to every agent, so whatever belongs to a run can be found by it later.
- ``reap_leftovers(out)``: a run SIGKILLed before it could stop its children leaves them behind
  only briefly (the engine, the proxy and every agent's guard get a signal when it dies:
  ``PR_SET_PDEATHSIG``), but a restarted run on the same output directory still stops any process
  that carries the directory's mark first (SIGTERM, then SIGKILL).
- ``remove_run_containers(out)``: the same for the docker sandbox's containers, found by their
  ``fineenvs.run`` label (a hash of the output directory), at a restart and at the run's end.
- ``stop_on_signals(out)``: SIGTERM (what SLURM sends at a time limit or ``scancel``) and SIGINT
  stop the run the way Ctrl-C does, by raising ``KeyboardInterrupt`` in the main thread, so every
  component stops in reverse order; first each running attempt's guard is told to take its agent
  down (the interpreter would otherwise wait for the attempts' threads, up to the attempt timeout).
  The stop is recorded in ``<out>/stopped.json``: the signal, the time, the attempts cut off.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from types import FrameType

from fineenvs.harnesses.guard import RUN_MARKER_ENV, pids_with_env

STOPPED_FILE = "stopped.json"

_stop: dict[str, object] = {}


def mark_run(out: Path) -> str:
    value = str(Path(out).resolve())
    os.environ[RUN_MARKER_ENV] = value
    return value


def _ancestors() -> set[int]:
    pids, pid = {os.getpid()}, os.getpid()
    while pid > 1:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            pid = int(stat.rsplit(")", 1)[-1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        pids.add(pid)
    return pids


def run_processes(out: Path) -> list[int]:
    """Live processes carrying the mark of the run on ``out`` (not this process or its ancestors)."""
    return _marked(str(Path(out).resolve()))


def _marked(value: str) -> list[int]:
    return pids_with_env(RUN_MARKER_ENV, value, _ancestors())


def reap_leftovers(out: Path, grace_s: float = 5.0) -> list[int]:
    """Stop every process an earlier run on ``out`` left behind; return their pids."""
    value = str(Path(out).resolve())
    found: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGKILL, signal.SIGKILL):
        # Rescanned every round: a leftover may fork between the scan and the signal (a shell
        # starting its command), and that child carries the mark too.
        live = _marked(value)
        if not live:
            break
        found += [pid for pid in live if pid not in found]
        for pid in live:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 2.0)
        while time.monotonic() < deadline and _marked(value):
            time.sleep(0.1)
    return found


def remove_run_containers(out: Path) -> list[str]:
    """Remove the containers labelled with the run on ``out`` (the docker sandbox's; an earlier run
    killed before its attempts' guards could remove them, or this run's at its end); returns their ids.
    Nothing to do, and no daemon asked, where no docker client is installed."""
    import shutil

    if shutil.which("docker") is None:
        return []
    from fineenvs.harnesses.container import remove_run_containers as remove
    from fineenvs.harnesses.container import run_id

    return remove(run_id(str(Path(out).resolve())))


def stop_on_signals(out: Path) -> None:
    """From now on, SIGTERM and SIGINT stop this run as Ctrl-C does (see the module docstring)."""

    def handle(signum: int, frame: FrameType | None) -> None:
        from fineenvs.harnesses.sandbox import stop_live_attempts

        first = not _stop
        cut = stop_live_attempts()
        if not first and time.time() - float(str(_stop["time"])) < 2.0:
            return  # the same stop reaching us twice (Ctrl-C signals the whole process group)
        if first:
            _stop.update(
                signal=signal.Signals(signum).name, signum=signum, time=time.time(), attempts_cut_off=cut
            )
            try:
                Path(out).mkdir(parents=True, exist_ok=True)
                (Path(out) / STOPPED_FILE).write_text(json.dumps(_stop, indent=1) + "\n")
            except OSError:
                pass
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)


def stopped_by() -> tuple[str, int] | None:
    """The signal that stopped this run (name, number), if one did."""
    if not _stop:
        return None
    return str(_stop["signal"]), int(str(_stop["signum"]))
