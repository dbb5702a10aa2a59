"""``scripts/slurm/ray_cluster.sbatch`` for real, on the one-node SLURM of
``scripts/slurm/local_slurm.sh`` (``make test-slurm`` starts and stops it):

- ``sbatch --nodes=1 --wait`` of the smoke run: the job exits 0, the run trained its step, every
  attempt ran on the job's Ray node (the head, which advertises the sandbox resource on a
  one-node allocation), the proxy recorded each graded attempt's calls; afterwards no process of
  the job's Ray cluster and none of the run is left, and the SLURM daemons are still up.
- ``scancel`` of a running job once its first agent has started (every process of the job
  signalled), and ``scancel --batch --signal=TERM`` (the batch shell only, as the time limit's
  ``--signal=B:TERM@120`` does: its trap stops the driver before the head): no process of the
  job's Ray cluster, of the run or of an agent is left.

The job's Ray processes are found by the job's own Ray temp folder (``/tmp/fe-ray-<job id>``, on
every one of their command lines, and their descendants), the run's and the agents' by their
environment marks (``fineenvs.lifecycle``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fineenvs.lifecycle import run_processes
from fineenvs.paths import REPO_ROOT
from fineenvs.rollout.ray_backend import PLACEMENT_FILE
from tests.integration.runs import attempt_processes

pytestmark = pytest.mark.slurm
pytest.importorskip("ray", reason="make test-ray installs ray==2.60.0")

# After the importorskip: the helpers' module imports ray-only names.
from tests.integration.test_ray_existing_cluster import _own_processes  # noqa: E402

SLURM_DIR = Path(os.environ.get("FINEENVS_SLURM_DIR", "/tmp/fineenvs-slurm"))
SBATCH = REPO_ROOT / "scripts" / "slurm" / "ray_cluster.sbatch"
# One harness, one task (a group of two attempts), one step, one evaluated task: the subject is
# the template's cluster around the run, not the run.
RUN = [
    "+experiment=smoke", "harness=mini_swe_agent", "tasks.limit=1", "trainer.max_steps=1",
    "trainer.eval_steps=1", "eval.subset_during_training=1",
]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def slurm_env() -> dict[str, str]:
    conf = SLURM_DIR / "slurm.conf"
    env = dict(os.environ, SLURM_CONF=str(conf))
    res = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], env=env, capture_output=True, text=True)
    if res.returncode != 0 or not res.stdout.strip().startswith(("idle", "mix")):
        pytest.fail(
            f"no idle SLURM node through {conf} (sinfo: {res.stdout.strip()!r} {res.stderr.strip()!r}). "
            "Fix: scripts/slurm/local_slurm.sh start (or make test-slurm, which starts it)"
        )
    return env


def _job_env(slurm_env: dict[str, str], out: Path) -> dict[str, str]:
    # Ports of their own: other Ray clusters and proxies may run on this machine (the ray tier).
    # No dashboard: its fixed port 8265 would collide with theirs.
    return dict(
        slurm_env,
        OUT=str(out),
        RAY_PORT=str(_free_port()),
        PROXY_PORT=str(_free_port()),
        RAY_HEAD_ARGS="--include-dashboard=false",
        HEAD_CPUS="1",
        SANDBOX_SLOTS="4",
        OBJECT_STORE_MB="100",
        WANDB_MODE="disabled",
        PYTHONUNBUFFERED="1",
    )


def _sbatch(env: dict[str, str], log: Path, *extra: str) -> list[str]:
    return [
        "sbatch", "--parsable", "--nodes=1", "--cpus-per-task=2", "--time=15:00", f"--output={log}",
        *extra, str(SBATCH), *RUN,
    ]  # fmt: skip


def _job_id(stdout: str) -> str:
    match = re.match(r"(\d+)", stdout.strip())
    assert match, f"sbatch printed no job id: {stdout!r}"
    return match.group(1)


def _ray_tmp(job: str) -> Path:
    return Path(f"/tmp/fe-ray-{job}")


def _log(path: Path) -> str:
    return path.read_text(errors="replace")[-5000:] if path.is_file() else "(no job output)"


def _job_field(job: str, env: dict[str, str], field: str) -> str:
    res = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True)
    match = re.search(rf"\b{field}=(\S+)", res.stdout)
    return match.group(1) if match else ""


def _daemons_up() -> None:
    for name in ("munged", "slurmctld", "slurmd"):
        pid = int((SLURM_DIR / f"{name}.pid").read_text())
        assert Path(f"/proc/{pid}").exists(), f"{name} ({pid}) is gone after the job"


def _leftovers(job: str, out: Path) -> list[int]:
    return sorted(set(_own_processes(_ray_tmp(job)) + run_processes(out) + attempt_processes(out)))


def _gone(job: str, out: Path, within: float) -> list[int]:
    deadline = time.monotonic() + within
    while (left := _leftovers(job, out)) and time.monotonic() < deadline:
        time.sleep(1)
    return left


def _cmdlines(pids: list[int]) -> list[str]:
    lines = []
    for pid in pids:
        try:
            lines.append(
                f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
            )
        except OSError:
            continue
    return lines


@pytest.fixture
def jobs(slurm_env: dict[str, str]) -> Iterator[list[str]]:
    """The test's job ids: cancelled if still there, their Ray temp folders removed (the template
    keeps them for their logs)."""
    ids: list[str] = []
    yield ids
    for job in ids:
        subprocess.run(["scancel", job], env=slurm_env, capture_output=True)
        shutil.rmtree(_ray_tmp(job), ignore_errors=True)


def test_one_node_job_runs_and_leaves_nothing(
    slurm_env: dict[str, str], jobs: list[str], tmp_path: Path
) -> None:
    out, log = tmp_path / "run", tmp_path / "job.out"
    env = _job_env(slurm_env, out)
    res = subprocess.run(
        [*_sbatch(env, log, "--wait")], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    job = _job_id(res.stdout)
    jobs.append(job)
    assert res.returncode == 0, f"job {job} failed ({res.returncode}): {res.stderr}\n{_log(log)}"
    assert _job_field(job, slurm_env, "ExitCode") == "0:0", _log(log)
    text = log.read_text(errors="replace")
    assert "Ray cluster up: 1 nodes" in text, _log(log)

    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["rows_trained"] > 0, summary
    attempts = [json.loads(line) for line in (out / "attempts.jsonl").read_text().splitlines()]
    assert {a["harness"] for a in attempts} == {"mini_swe_agent"}, attempts
    assert not [a for a in attempts if a["exit_reason"] == "infra_failure"], attempts

    # The Ray node the job started: this machine's node ids in the job's session folder.
    session = _ray_tmp(job) / "session_latest"
    node_ids = {p.name.rsplit("_", 1)[1] for p in session.glob("*_port_*")}
    assert len(node_ids) == 1, sorted(p.name for p in session.iterdir())
    trained = [json.loads(p.read_text()) for p in (out / "attempts").rglob(PLACEMENT_FILE)]
    evaluated = [json.loads(p.read_text()) for p in (out / "eval").rglob(PLACEMENT_FILE)]
    assert len(trained) == len(attempts) and evaluated, (trained, evaluated)
    assert {p["node_id"] for p in trained + evaluated} == node_ids, (trained, evaluated, node_ids)
    assert {p["hostname"] for p in trained + evaluated} == {socket.gethostname()}, trained

    # The run's records: the proxy's record of every graded attempt's calls.
    sessions = {}
    for meta in (out / "records" / "sessions").glob("*/meta.json"):
        sessions[json.loads(meta.read_text())["metadata"].get("attempt")] = meta.parent
    graded = [a for a in attempts if a["reward"] is not None]
    assert graded, attempts
    for a in graded:
        calls = (sessions[a["attempt_id"]] / "calls.jsonl").read_text().splitlines()
        assert len(calls) == a["model_calls"] >= 1, f"the proxy's records of {a['attempt_id']}"

    left = _gone(job, out, within=30)
    assert not left, f"processes of job {job} outlived it: {_cmdlines(left)}"
    _daemons_up()


@pytest.mark.parametrize(
    "scancel",
    [
        # Every process of the job gets SIGTERM at once, SIGKILL after KillWait (30 s here).
        pytest.param([], id="scancel"),
        # Only the batch shell, as --signal=B:TERM@120 does before the time limit: its trap stops
        # the driver first, then the Ray nodes.
        pytest.param(["--batch", "--signal=TERM"], id="batch-TERM"),
    ],
)
def test_scancel_stops_the_cluster_and_the_agents(
    slurm_env: dict[str, str], jobs: list[str], tmp_path: Path, scancel: list[str]
) -> None:
    out, log = tmp_path / "run", tmp_path / "job.out"
    env = _job_env(slurm_env, out)
    res = subprocess.run(
        _sbatch(env, log), cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    job = _job_id(res.stdout)
    jobs.append(job)

    # Cancelled once an agent runs: the hardest case, an agent in a session of its own under a
    # Ray worker under a raylet under `ray start --block`.
    deadline = time.monotonic() + 420
    while not attempt_processes(out):
        state = _job_field(job, slurm_env, "JobState")
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"job {job} is {state}: {_log(log)}"
        assert time.monotonic() < deadline, f"no agent of job {job} after 420 s: {_log(log)}"
        time.sleep(1)
    assert _own_processes(_ray_tmp(job)), "the job's Ray cluster is not running"
    subprocess.run(["scancel", *scancel, job], env=slurm_env, check=True)

    deadline = time.monotonic() + 120
    while _job_field(job, slurm_env, "JobState") not in ("CANCELLED", "COMPLETED", "FAILED", ""):
        assert time.monotonic() < deadline, f"job {job} not ended 120 s after scancel"
        time.sleep(1)
    left = _gone(job, out, within=30)
    assert not left, f"processes of job {job} outlived scancel: {_cmdlines(left)}"
    assert not (out / "summary.json").exists(), "the run finished before scancel: nothing was tested"
    text = log.read_text(errors="replace")
    stopped = text.find("fineenvs: stopped by SIGTERM")
    assert stopped >= 0, f"the run did not stop on SIGTERM: {_log(log)}"
    if scancel:
        # The trap's order: the run has stopped (its attempts cancelled) before the head drains.
        assert 0 <= stopped < text.find("received SIGTERM. Draining"), _log(log)
    _daemons_up()
