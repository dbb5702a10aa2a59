"""What the whole-run tests share: the smoke run's command line and the processes of a run's
attempts (not a test module)."""

from __future__ import annotations

import sys
from pathlib import Path

from fineenvs.harnesses.sandbox import MARKER_ENV
from fineenvs.lifecycle import run_processes


def smoke_command(out: Path, harnesses: list[str], *extra: str) -> list[str]:
    """``python -m fineenvs.run +experiment=smoke`` with ``harnesses`` into ``out``, plus ``extra``."""
    return [
        sys.executable,
        "-m",
        "fineenvs.run",
        "+experiment=smoke",
        f"harness=[{','.join(harnesses)}]",
        f"hydra.run.dir={out}",
        *extra,
    ]


def attempt_processes(out: Path) -> list[int]:
    """Processes of the run in ``out`` that belong to an attempt (they carry an attempt marker):
    guards, agents, and with the docker sandbox the ``docker run`` clients."""
    found = []
    for pid in run_processes(out):
        try:
            if f"{MARKER_ENV}=".encode() in Path(f"/proc/{pid}/environ").read_bytes():
                found.append(pid)
        except OSError:
            continue
    return found
