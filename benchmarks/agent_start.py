"""Benchmark of an npm agent's start: ``python -m benchmarks agent-start [--harness pi ...]``.

A headless attempt is one fresh agent process, so its start is paid once per attempt; for Pi it
is most of what an attempt of the learning test costs. For each agent, the start that fills its
compile cache (``Harness.warm_argv``, e.g. ``pi --version``) runs in three set-ups, taken in turn
within each repeat so that a machine whose speed drifts affects all three alike:

1. ``system``: the machine's ``node``, no compile cache (the baseline: how agents ran before);
2. ``pinned``: the pinned Node (fineenvs/harnesses/node.py), no compile cache;
3. ``pinned+cache``: the pinned Node with the agent's warmed compile cache, as attempts run it.

Printed per set-up: the median wall time and the median CPU time (user + system, of the process
and its children) over ``--repeats`` starts, and each as a ratio of the baseline's.

Results: benchmarks/results/2026-12-04-agent-start-2core.md.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from fineenvs.harnesses import get_harness
from fineenvs.harnesses.base import Harness
from fineenvs.harnesses.node import NODE

SETUPS = ("system", "pinned", "pinned+cache")


def _env(h: Harness, home: Path, setup: str) -> dict[str, str]:
    env = h.base_env(home)
    if setup == "system":
        node = shutil.which("node")
        if node is None:
            raise SystemExit("no `node` on PATH for the baseline (the machine's Node)")
        dirs = [d for d in env["PATH"].split(os.pathsep) if d != str(NODE.bin_dir)]
        env["PATH"] = os.pathsep.join([str(h.bin_dir), str(Path(node).resolve().parent), *dirs])
    if setup != "pinned+cache":
        env.pop("NODE_COMPILE_CACHE", None)
    return env


def _start(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[float, float]:
    """Wall and CPU seconds of one start (CPU of the children this process waited for)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, timeout=300, check=False)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace")[-400:]
        raise SystemExit(f"`{' '.join(argv)}` failed (exit {done.returncode}): {tail}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def measure(h: Harness, repeats: int) -> dict[str, tuple[float, float]]:
    """setup -> (median wall s, median CPU s)."""
    walls: dict[str, list[float]] = {s: [] for s in SETUPS}
    cpus: dict[str, list[float]] = {s: [] for s in SETUPS}
    with tempfile.TemporaryDirectory(prefix="fineenvs-bench-start-") as tmp:
        home = Path(tmp)
        (home / "tmp").mkdir()
        for _ in range(repeats):
            for setup in SETUPS:
                wall, cpu = _start(h.warm_argv(), _env(h, home, setup), home)
                walls[setup].append(wall)
                cpus[setup].append(cpu)
    return {s: (statistics.median(walls[s]), statistics.median(cpus[s])) for s in SETUPS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks agent-start", description=__doc__)
    parser.add_argument("--harness", action="append", help="npm agent(s) to start (default: pi)")
    parser.add_argument("--repeats", type=int, default=7, help="starts per set-up (default 7)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    names = args.harness or ["pi"]
    harnesses = [get_harness(n) for n in names]
    for h in harnesses:
        if h.registry != "npm":
            parser.error(f"{h.name} is not an npm agent: it does not run on Node")
        if not (h.is_installed() and NODE.is_installed()):
            parser.error(
                f"{h.name} or the pinned Node is not installed: python -m fineenvs.harnesses install {h.name}"
            )
    print(
        f"agent start, median of {args.repeats} (system node: {shutil.which('node')}; pinned: node {NODE.version})"
    )
    print(f"{'agent':14} {'set-up':14} {'wall s':>8} {'x base':>7} {'CPU s':>8} {'x base':>7}")
    for h in harnesses:
        figures = measure(h, args.repeats)
        base_wall, base_cpu = figures["system"]
        for setup in SETUPS:
            wall, cpu = figures[setup]
            print(
                f"{h.name:14} {setup:14} {wall:8.2f} {wall / base_wall:7.2f} {cpu:8.2f} {cpu / base_cpu:7.2f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
