"""Attempt start-up overhead per sandbox: ``python -m benchmarks sandbox-start [--harness mini_swe_agent]``.

One attempt is run with :func:`fineenvs.harnesses.sandbox.run_attempt` in each sandbox (``plain``,
``bwrap``, ``docker``), taken in turn within each repeat so that a machine whose speed drifts
affects all three alike. Two commands:

* ``true``: the sandbox alone (folders, guard, bwrap or ``docker run`` and the proxy bridge, teardown);
* the harness's own ``--help`` (which loads its code), the same agent in every
  sandbox, so its start inside the sandbox is counted too.

Printed: the median wall time of the whole attempt over ``--repeats`` runs, and its overhead over
``plain``. The docker sandbox's image is built (or found) before timing starts.

Results: benchmarks/results/2026-12-06-sandbox-startup-2core.md.
"""

from __future__ import annotations

import argparse
import copy
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from fineenvs.harnesses import get_harness
from fineenvs.harnesses.base import Harness, Launch
from fineenvs.harnesses.container import DockerSettings, daemon_problem, default_image
from fineenvs.harnesses.sandbox import run_attempt

SANDBOXES = ("plain", "bwrap", "docker")


def _quick(real: Harness, argv: list[str]) -> Harness:
    """The real harness (its environment, config files, paths), running only ``argv``."""

    class Quick(type(real)):  # type: ignore[misc]
        def command(self, launch: Launch) -> list[str]:
            return list(argv)

    quick = copy.copy(real)
    quick.__class__ = Quick
    return quick


def _once(h: Harness, sandbox: str, root: Path) -> float:
    started = time.perf_counter()
    result = run_attempt(
        h,
        task_prompt="benchmark",
        input_files={},
        attempt_dir=Path(tempfile.mkdtemp(dir=root)),
        base_url="http://127.0.0.1:9/s/k",  # never called: the command makes no model call
        session_key="k",
        model="m",
        timeout_seconds=120,
        use_bwrap=sandbox == "bwrap",
        docker=DockerSettings() if sandbox == "docker" else None,
    )
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(
            f"{h.name} in {sandbox} failed ({result.returncode}): {result.detail} in {result.attempt_dir}"
        )
    return wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks sandbox-start", description=__doc__)
    parser.add_argument("--harness", default="mini_swe_agent", help="agent to start (default mini_swe_agent)")
    parser.add_argument("--repeats", type=int, default=7, help="attempts per sandbox and command (default 7)")
    args = parser.parse_args(argv)
    real = get_harness(args.harness)
    if not real.is_installed():
        parser.error(f"{real.name} is not installed: python -m fineenvs.harnesses install {real.name}")
    if shutil.which("bwrap") is None:
        parser.error("bwrap is not installed: apt-get install bubblewrap")
    problem = daemon_problem()
    if problem:
        parser.error(problem)
    print(f"default image {default_image()} ready")
    commands = {
        "true": _quick(real, ["/bin/true"]),
        "agent --help": _quick(real, [str(real.binary_path), "--help"]),
    }
    print(f"attempt start-up, median of {args.repeats} ({real.name} {real.version})")
    print(f"{'command':18} {'sandbox':8} {'wall s':>8} {'+ plain s':>10}")
    with tempfile.TemporaryDirectory(prefix="fineenvs-bench-") as tmp:
        for label, h in commands.items():
            _once(h, "docker", Path(tmp))  # warm: page cache, the agent's first start
            times: dict[str, list[float]] = {s: [] for s in SANDBOXES}
            for _ in range(args.repeats):
                for sandbox in SANDBOXES:
                    times[sandbox].append(_once(h, sandbox, Path(tmp)))
            base = statistics.median(times["plain"])
            for sandbox in SANDBOXES:
                median = statistics.median(times[sandbox])
                print(f"{label:18} {sandbox:8} {median:8.2f} {median - base:10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
