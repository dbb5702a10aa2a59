"""Attempts on an EXISTING Ray cluster (``scheduler.ray.address``), started the way a user starts one:
the Ray CLI of the venv, a head without the ``sandbox`` resource and a rollout node with it
(``NODE_ENV`` in its environment), both on this machine, with Ray's token authentication on.

- The smoke run with two real harnesses through that cluster: every attempt ran on the rollout
  node (its Ray node id in ``placement.json``), rewards and rows as in the local-cluster smoke run,
  and the cluster is still up afterwards (the run never stops a cluster it did not start: a fresh
  driver sees both nodes alive); no process of the run's attempts is left.
- A two-job Hydra multirun of harness mixes against the same cluster: both jobs finish, each
  job's attempts on the rollout node, the cluster still up.

The cluster is stopped at the end by its own processes (those naming its temp folder and their
children), never by ``ray stop``, which ends every Ray process on the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fineenvs.harnesses import check_installed
from fineenvs.lifecycle import run_processes
from fineenvs.paths import REPO_ROOT
from fineenvs.rollout.ray_backend import CLUSTER_FILE, NODE_ENV, PLACEMENT_FILE
from tests.integration.runs import attempt_processes, smoke_command

pytestmark = pytest.mark.ray
pytest.importorskip("ray", reason="make test-ray installs ray==2.60.0")

HARNESSES = ["mini_swe_agent", "opencode"]
RAY = str(Path(sys.executable).parent / "ray")


@dataclass
class UserCluster:
    address: str
    temp_dir: Path
    env: dict[str, str]
    head_id: str
    rollout_id: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _own_processes(temp_dir: Path) -> list[int]:
    """The cluster's processes: those naming its temp folder (GCS, raylets, monitors) and their
    descendants (workers, agents of the raylets)."""
    roots = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if str(temp_dir).encode() in (entry / "cmdline").read_bytes():
                    roots.append(int(entry.name))
    found, todo = set(roots), list(roots)
    while todo:
        pid = todo.pop()
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                for child in (task / "children").read_text().split():
                    if int(child) not in found:
                        found.add(int(child))
                        todo.append(int(child))
    return sorted(found)


def _stop(temp_dir: Path) -> None:
    """SIGTERM the cluster's own processes, SIGKILL what is left after 10 s (the GCS ignores SIGTERM
    for a while, measured): what ``ray stop`` does, limited to this cluster."""
    pids = _own_processes(temp_dir)
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            pids = [p for p in pids if Path(f"/proc/{p}").exists() and not _zombie(p)]
            if not pids:
                return
            time.sleep(0.2)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] == "Z"
    except OSError:
        return True


def _nodes(address: str, env: dict[str, str]) -> list[dict]:
    """The cluster's nodes as a fresh driver sees them (``ray.nodes()``)."""
    code = (
        "import json, ray\n"
        f"ray.init(address={address!r}, log_to_driver=False, configure_logging=False)\n"
        "print(json.dumps([{'id': n['NodeID'], 'alive': n['Alive'], 'ip': n['NodeManagerAddress'],"
        " 'sandbox': n['Resources'].get('sandbox', 0)} for n in ray.nodes()]))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def user_cluster() -> Iterator[UserCluster]:
    # Ray's unix sockets live under the temp folder: keep its path short (a 107-byte limit).
    temp_dir = Path(tempfile.mkdtemp(prefix="fe-rx-", dir="/tmp"))
    port = _free_port()
    # Ray 2.60's CLI turns 127.0.0.1 into this machine's interface address and listens on every
    # interface (docs/cluster.md): token authentication keeps other hosts from using the cluster.
    env = dict(
        os.environ,
        RAY_USAGE_STATS_ENABLED="0",
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=secrets.token_hex(16),
    )
    env.pop("RAY_ADDRESS", None)
    store = "--object-store-memory=100000000"
    try:
        subprocess.run(
            [RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=1", store,
             f"--temp-dir={temp_dir}", "--disable-usage-stats", "--include-dashboard=false"],
            env=env, check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        subprocess.run(
            [RAY, "start", f"--address=127.0.0.1:{port}", "--node-ip-address=127.0.0.1", "--num-cpus=1",
             '--resources={"sandbox": 4}', store, "--disable-usage-stats"],
            env={**env, **NODE_ENV}, check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        address = f"127.0.0.1:{port}"
        nodes = _nodes(address, env)
        assert len(nodes) == 2 and all(n["alive"] for n in nodes), nodes
        (rollout,) = [n["id"] for n in nodes if n["sandbox"] == 4]
        (head,) = [n["id"] for n in nodes if n["id"] != rollout]
        yield UserCluster(address, temp_dir, env, head, rollout)
    finally:
        _stop(temp_dir)
        left = _own_processes(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, f"processes of the test's cluster outlived it: {left}"


def _still_up(cluster: UserCluster) -> None:
    nodes = _nodes(cluster.address, cluster.env)
    assert {n["id"] for n in nodes if n["alive"]} == {cluster.head_id, cluster.rollout_id}, nodes


def _log_tail(path: Path) -> str:
    return path.read_text(errors="replace")[-4000:] if path.is_file() else ""


def _run(argv: list[str], cluster: UserCluster, log: Path, timeout: float) -> None:
    env = dict(cluster.env, WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    with log.open("wb") as f:
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            assert proc.wait(timeout=timeout) == 0, _log_tail(log)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _check_job(out: Path, cluster: UserCluster, harnesses: list[str], steps: int = 2) -> dict:
    """One job's outcome on the cluster: steps trained, every graded attempt on the rollout node
    with the proxy's records of its calls, the evaluation's attempts there too, nothing left."""
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == steps and summary["rows_trained"] > 0, summary
    attempts = [json.loads(line) for line in (out / "attempts.jsonl").read_text().splitlines()]
    assert {a["harness"] for a in attempts} == set(harnesses), attempts
    assert not [a for a in attempts if a["exit_reason"] == "infra_failure"], attempts
    graded = [a for a in attempts if a["reward"] is not None]
    assert graded, attempts
    sessions = {}
    for meta in (out / "records" / "sessions").glob("*/meta.json"):
        sessions[json.loads(meta.read_text())["metadata"].get("attempt")] = meta.parent
    for a in attempts:
        folder = next((out / "attempts").rglob(f"{a['attempt_id']}/{PLACEMENT_FILE}")).parent
        assert json.loads((folder / PLACEMENT_FILE).read_text())["node_id"] == cluster.rollout_id, a
    for a in graded:
        calls = (sessions[a["attempt_id"]] / "calls.jsonl").read_text().splitlines()
        assert len(calls) == a["model_calls"] >= 1, f"the proxy's records of {a['attempt_id']}"
        assert "correctness" in a["reward_terms"], a
    assert sum(a["rows"] for a in graded) >= summary["rows_trained"] > 0
    evaluated = [json.loads(p.read_text())["node_id"] for p in (out / "eval").rglob(PLACEMENT_FILE)]
    assert evaluated and set(evaluated) == {cluster.rollout_id}, evaluated
    # The run started no cluster of its own, and left no process of its attempts.
    assert not (out / CLUSTER_FILE).exists()
    assert not attempt_processes(out) and not run_processes(out)
    return summary


def test_smoke_run_on_an_existing_cluster(user_cluster: UserCluster, tmp_path: Path) -> None:
    out = tmp_path / "ray-existing"
    problems = check_installed(HARNESSES)
    assert not problems, "; ".join(problems)
    argv = smoke_command(
        out, HARNESSES, "scheduler.backend=ray", f"scheduler.ray.address={user_cluster.address}"
    )
    _run(argv, user_cluster, tmp_path / "run.log", timeout=900)
    log = (tmp_path / "run.log").read_text(errors="replace")
    assert f"Built Ray backend on {user_cluster.address}" in log, log[-3000:]
    _check_job(out, user_cluster, HARNESSES)
    _still_up(user_cluster)


def test_a_harness_mix_multirun_shares_the_existing_cluster(
    user_cluster: UserCluster, tmp_path: Path
) -> None:
    sweep = tmp_path / "multirun"
    argv = [
        sys.executable, "-m", "fineenvs.run", "-m", "+experiment=smoke", "harness=opencode,mini_swe_agent",
        "scheduler.backend=ray", f"scheduler.ray.address={user_cluster.address}", f"hydra.sweep.dir={sweep}",
        # Shorter jobs than the smoke run's (one group, one step, one evaluated task): the subject
        # here is two runs one after another on one cluster.
        "tasks.limit=1", "trainer.max_steps=1", "trainer.eval_steps=1", "eval.subset_during_training=1",
    ]  # fmt: skip
    _run(argv, user_cluster, tmp_path / "multirun.log", timeout=1200)
    jobs = {}
    for out in sorted(p for p in sweep.iterdir() if p.is_dir() and (p / "summary.json").is_file()):
        harnesses = {
            json.loads(line)["harness"] for line in (out / "attempts.jsonl").read_text().splitlines()
        }
        (harness,) = harnesses
        _check_job(out, user_cluster, [harness], steps=1)
        jobs[harness] = out
    assert set(jobs) == {"opencode", "mini_swe_agent"}, sorted(sweep.iterdir())
    _still_up(user_cluster)
