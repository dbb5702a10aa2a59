"""The pinned Node the npm agents run on, measured: the agent-start benchmark prints its figures."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fineenvs.harnesses import check_installed
from fineenvs.harnesses.node import NODE
from fineenvs.paths import REPO_ROOT

pytestmark = [pytest.mark.harness, pytest.mark.slow]


def test_agent_start_benchmark_prints_every_setup_against_the_system_node() -> None:
    problems = check_installed(["pi"])
    assert not problems, "; ".join(problems)
    cmd = [sys.executable, "-m", "benchmarks", "agent-start", "--harness", "pi", "--repeats", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    rows = {tuple(line.split()[:2]): line.split()[2:] for line in done.stdout.splitlines()[2:]}
    assert set(rows) == {("pi", "system"), ("pi", "pinned"), ("pi", "pinned+cache")}, done.stdout
    assert f"node {NODE.version}" in done.stdout
    assert rows[("pi", "system")][1] == "1.00" and rows[("pi", "system")][3] == "1.00"
    assert all(float(v) > 0 for figures in rows.values() for v in figures)
