"""The smoke run with every attempt in a container (``scheduler.sandbox=docker``), two real agent
CLIs (Mini-SWE-Agent and OpenCode), and a SIGTERM or SIGKILL of the run that must leave no
container and no process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from fineenvs.harnesses import check_installed
from fineenvs.harnesses import container as ct
from fineenvs.lifecycle import run_processes
from fineenvs.paths import REPO_ROOT
from tests.integration.runs import smoke_command

HARNESSES = ["mini_swe_agent", "opencode"]

pytestmark = [
    pytest.mark.containers,
    # Not skipped without a daemon: the tier that selects this marker starts one, so its absence
    # is a failure there (make test-containers).
    pytest.mark.usefixtures("docker_daemon"),
]


@pytest.fixture(autouse=True)
def _needs_agents() -> None:
    problems = check_installed(HARNESSES)
    if problems:
        pytest.fail("the docker smoke run needs its agent CLIs: " + "; ".join(problems))


def test_smoke_run_in_containers_with_two_harnesses(tmp_path: Path) -> None:
    out = tmp_path / "smoke"
    # What an earlier run on this folder left (a restart), and a container of another run.
    left = _sleeper(ct.run_id(str(out)))
    foreign = _sleeper(ct.run_id(str(tmp_path / "another-run")))
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    try:
        res = subprocess.run(
            smoke_command(out, HARNESSES, "scheduler.sandbox=docker"),
            capture_output=True,
            text=True,
            cwd=REPO_ROOT,
            env=env,
            timeout=1200,
        )
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        assert f"removed 1 container(s) an earlier run on {out} left behind" in res.stdout
        alive = subprocess.run(["docker", "ps", "-q", "--no-trunc"], capture_output=True, text=True).stdout
        assert left not in alive and foreign in alive
    finally:
        subprocess.run(["docker", "rm", "-f", left, foreign], capture_output=True)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["rows_trained"] > 0
    attempts = [json.loads(line) for line in (out / "attempts.jsonl").read_text().splitlines()]
    assert {a["harness"] for a in attempts} == set(HARNESSES)
    # Rewards and rows as with the local runner: every attempt graded, each one's calls made rows.
    assert all(a["reward"] is not None and a["model_calls"] > 0 for a in attempts), attempts
    assert all(a["metrics"]["rows"] > 0 for a in attempts)
    records = [json.loads(p.read_text()) for p in (out / "attempts").glob("*/*/attempt.json")]
    assert records and all(r["container"] and r["argv"][1] == "run" for r in records)
    assert {"/tmp/home", "/tmp/work"} <= {
        arg.split(":")[1] for arg in records[0]["argv"] if arg.count(":") == 1
    }
    assert ct.run_containers(ct.run_id(str(out))) == []


def _sleeper(rid: str) -> str:
    done = subprocess.run(
        ["docker", "run", "-d", "--label", f"{ct.RUN_LABEL}={rid}", ct.default_image(), "sleep", "600"],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_stopped_or_killed_docker_run_leaves_no_container_and_no_process(
    tmp_path: Path, sig: signal.Signals
) -> None:
    out = tmp_path / "term"
    out.mkdir()
    rid = ct.run_id(str(out))
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    log = (tmp_path / "term.log").open("wb")
    run = subprocess.Popen(
        smoke_command(out, HARNESSES, "scheduler.sandbox=docker", "trainer.max_steps=50"),
        cwd=REPO_ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 600
        while len(ct.run_containers(rid)) < 2:  # agents at work in their containers
            assert run.poll() is None, (tmp_path / "term.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no container of the run started within 10 minutes"
            time.sleep(0.5)
        run.send_signal(sig)  # SIGKILL: the run alone, as the OOM killer would; its guards must clean up
        expected = 128 + signal.SIGTERM if sig == signal.SIGTERM else -signal.SIGKILL
        assert run.wait(timeout=180) == expected, (tmp_path / "term.log").read_text()[-3000:]
    finally:
        if run.poll() is None:
            run.kill()
    deadline = time.monotonic() + 30  # after SIGKILL the guards remove the containers themselves
    while (run_processes(out) or ct.run_containers(rid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ct.run_containers(rid) == []
    assert run_processes(out) == []
    clients = subprocess.run(["pgrep", "-f", f"label={ct.RUN_LABEL}={rid}"], capture_output=True, text=True)
    assert clients.stdout.split() == []
