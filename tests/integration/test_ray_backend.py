"""Attempts on a Ray cluster (``scheduler.backend=ray``), on a real local Ray cluster.

- The error mapping: a task whose rollout node dies (its raylet killed) is an
  ``InfrastructureFailure``, and so is one no node can take within its time; a remote exception
  stays the agent's own crash.
- The CPU smoke run with two real harnesses on a local cluster the run starts itself (a head and
  two rollout nodes): every attempt ran on a rollout node (Ray's own node id, recorded by the
  remote side, against the cluster's node list), the proxy recorded each attempt's calls, two
  optimizer steps trained; one rollout node is killed mid-attempt and the run still finishes,
  that attempt ungraded (``infra_failure``), never a 0 reward.
- SIGTERM of such a run leaves no process of the run and no Ray process or folder of its cluster.
- The start-up check: a rollout node that cannot reach the proxy stops the run with the fix.

The tier needs Ray (``make test-ray`` installs it) and, for the runs, the agent CLIs.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from fineenvs.harnesses import check_installed
from fineenvs.lifecycle import run_processes
from fineenvs.paths import REPO_ROOT
from fineenvs.rollout.ray_backend import (
    CLUSTER_FILE,
    PLACEMENT_FILE,
    RayAttempts,
    RaySettings,
    check_rollout_node,
    ray_attempts,
)
from fineenvs.rollout.scheduler import InfrastructureFailure
from tests.integration.runs import attempt_processes, smoke_command

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray", reason="make test-ray installs ray==2.60.0")
# The stand-in task below is pickled by value: Ray's workers need not import the tests.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

HARNESSES = ["mini_swe_agent", "opencode"]


def _raylets_of(temp_dir: str) -> list[int]:
    """Live processes whose command line names the cluster's temp folder (every Ray process of it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if temp_dir.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _sleeper(harness: str, kwargs: dict, rollout_url: str, admin_key: object, marker: object) -> tuple:
    """Stands in for the remote attempt (its signature and reply shape): the Ray hop is tested here."""
    if kwargs["fail"]:
        raise ValueError("the agent's own bug")
    (Path(kwargs["attempt_dir"]) / "started").touch()
    time.sleep(kwargs["seconds"])
    node = str(ray.get_runtime_context().get_node_id())
    return node, {}, {"node_id": node}


class _Health(BaseHTTPRequestHandler):
    """Stands in for the proxy's unauthenticated ``/health`` (the start-up check GETs it)."""

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b'{"status": "ok"}')

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def health_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def cluster(tmp_path: Path, health_url: str) -> Iterator[tuple[RayAttempts, dict]]:
    """A two-node local cluster (head + one rollout node) through the backend's own start-up."""
    settings = RaySettings(local_sandbox_nodes=1, placement_timeout_seconds=20)

    async def enter() -> tuple[object, RayAttempts]:
        cm = ray_attempts(settings, proxy_url=health_url, admin_key=None, out=tmp_path)
        return cm, await cm.__aenter__()

    loop = asyncio.new_event_loop()
    cm, attempts = loop.run_until_complete(enter())
    info = json.loads((tmp_path / CLUSTER_FILE).read_text())
    try:
        yield attempts, info
    finally:
        loop.run_until_complete(cm.__aexit__(None, None, None))  # type: ignore[attr-defined]
        loop.close()
    deadline = time.monotonic() + 15
    while _raylets_of(info["temp_dir"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _raylets_of(info["temp_dir"]), "Ray processes of the test's cluster outlived it"
    assert not Path(info["temp_dir"]).exists(), "the cluster's session folders were left behind"


def _run(attempts: RayAttempts, tmp_path: Path, seconds: float, fail: bool = False) -> object:
    attempts._task = ray.remote(_sleeper).options(resources={"sandbox": 1}, num_cpus=0, max_retries=0)
    (tmp_path / "a0").mkdir(exist_ok=True)
    kwargs = {
        "base_url": attempts.driver_proxy_url + "/s/k",
        "attempt_dir": str(tmp_path / "a0"),
        "timeout_seconds": 5,
        "seconds": seconds,
        "fail": fail,
    }
    return attempts.run("mini_swe_agent", kwargs, "/sessions/x/rollout")


def _listening(pids: set[int]) -> list[str]:
    """Local addresses (host:port) the processes ``pids`` listen on over TCP (``ss``)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        owners = {int(m) for m in re.findall(r"pid=(\d+)", line)}
        if owners & pids:
            found.append(line.split()[3])
    return found


def test_the_local_cluster_listens_on_loopback_only(cluster: tuple[RayAttempts, dict]) -> None:
    """Started by the run, the cluster has no token authentication: no other host may reach it."""
    _, info = cluster
    addresses = _listening(set(_raylets_of(info["temp_dir"])))
    assert len(addresses) >= 3, addresses  # the GCS and both raylets at least
    hosts = {a.rsplit(":", 1)[0] for a in addresses}
    assert hosts <= {"127.0.0.1", "[::ffff:127.0.0.1]"}, addresses


def test_a_rollout_node_that_cannot_reach_the_proxy_stops_the_start(
    cluster: tuple[RayAttempts, dict], tmp_path: Path
) -> None:
    """The check ``ray_attempts`` runs at start (it passed for the fixture's own proxy): against a
    closed port, as a loopback proxy URL is from another machine, it names the node, why and the fix."""
    _, info = cluster
    settings = RaySettings(placement_timeout_seconds=20)
    with pytest.raises(InfrastructureFailure) as err:
        check_rollout_node(tmp_path, settings, "http://127.0.0.1:9")
    msg = str(err.value)
    assert "cannot reach the proxy at http://127.0.0.1:9/health" in msg, msg
    assert info["sandbox_nodes"][0]["node_id"][:12] in msg, msg
    assert "loopback" in msg and "Fix: scheduler.ray.proxy_url=http://DRIVER_IP:PORT" in msg, msg
    assert "cannot read" not in msg, msg  # the output folder is shared here: only the proxy fails
    seen = check_rollout_node(tmp_path, settings, cluster[0].remote_proxy_url)
    assert seen["node_id"] == info["sandbox_nodes"][0]["node_id"] and seen["proxy_error"] is None


def test_node_death_is_an_infrastructure_failure(cluster: tuple[RayAttempts, dict], tmp_path: Path) -> None:
    attempts, info = cluster
    node = info["sandbox_nodes"][0]

    async def kill_mid_attempt() -> BaseException:
        task = asyncio.ensure_future(_run(attempts, tmp_path, seconds=30))
        while not (tmp_path / "a0" / "started").exists():  # mid-attempt: running on its node
            assert not task.done(), task
            await asyncio.sleep(0.1)
        os.kill(node["raylet_pid"], signal.SIGKILL)
        try:
            await asyncio.wait_for(task, 60)
        except BaseException as exc:  # noqa: BLE001 - what it raised is the subject
            return exc
        raise AssertionError("the attempt on a killed node returned a result")

    started = time.monotonic()
    err = asyncio.run(kill_mid_attempt())
    assert isinstance(err, InfrastructureFailure), repr(err)
    assert "NodeDiedError" in str(err) or "WorkerCrashedError" in str(err), str(err)
    assert time.monotonic() - started < 60
    # With its only rollout node gone, the next attempt cannot be placed: it fails in bounded time.
    err2 = None
    try:
        asyncio.run(_run(attempts, tmp_path, seconds=0))
    except BaseException as exc:  # noqa: BLE001
        err2 = exc
    assert isinstance(err2, InfrastructureFailure) and "unfinished after" in str(err2), repr(err2)


def test_attempt_lands_on_the_rollout_node_and_agent_errors_stay_crashes(
    cluster: tuple[RayAttempts, dict], tmp_path: Path
) -> None:
    attempts, info = cluster
    node_id, _ = asyncio.run(_run(attempts, tmp_path, seconds=0))
    assert json.loads((tmp_path / "a0" / PLACEMENT_FILE).read_text())["node_id"] == node_id
    assert node_id == info["sandbox_nodes"][0]["node_id"] != info["head"]["node_id"]
    with pytest.raises(ValueError, match="the agent's own bug"):
        asyncio.run(_run(attempts, tmp_path, seconds=0, fail=True))


# --------------------------------------------------------------------------- real runs


def _start(out: Path, *extra: str) -> subprocess.Popen[bytes]:
    problems = check_installed(HARNESSES)
    assert not problems, "; ".join(problems)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0")
    log = (out.parent / f"{out.name}.log").open("wb")
    return subprocess.Popen(
        smoke_command(out, HARNESSES, "scheduler.backend=ray", *extra),
        cwd=REPO_ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _log(out: Path) -> str:
    path = out.parent / f"{out.name}.log"
    return path.read_text(errors="replace")[-4000:] if path.is_file() else ""


def _ancestors(pid: int) -> set[int]:
    out = set()
    while pid > 1:
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        out.add(pid)
    return out


def _wait_for_agent(run: subprocess.Popen[bytes], out: Path) -> int:
    deadline = time.monotonic() + 600
    while True:
        agents = attempt_processes(out)
        if agents:
            return agents[0]
        assert run.poll() is None, "the run ended before an agent started: " + _log(out)
        assert time.monotonic() < deadline, "no agent started within 10 minutes"
        time.sleep(0.2)


def _finished_despite_a_lost_node(out: Path) -> tuple[dict, list[dict], list[dict]]:
    """The run's summary, attempts and the attempts lost with the node: two steps trained, both
    harnesses ran, and the lost attempts are infrastructure failures without a reward (never 0)."""
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["rows_trained"] > 0, summary
    attempts = [json.loads(line) for line in (out / "attempts.jsonl").read_text().splitlines()]
    lost = [a for a in attempts if a["exit_reason"] == "infra_failure"]
    assert lost, "the attempt on the killed node was not counted as an infrastructure failure"
    assert all(a["reward"] is None for a in lost), lost
    # Each lost attempt is recorded when lost and runs again under a fresh id (scheduler.infra_retries,
    # default 2) on a live node: its rerun is recorded with its group, unless the run reached its
    # steps before that group finished.
    ids = {a["attempt_id"] for a in attempts}
    finished_groups = {a["group_id"] for a in attempts if a["exit_reason"] != "infra_failure"}
    for a in lost:
        base, _, n = a["attempt_id"].partition("-retry")
        rerun = f"{base}-retry{int(n or 0) + 1}"
        assert rerun in ids or n == "2" or a["group_id"] not in finished_groups, (a, sorted(ids))
    assert summary["attempts_rerun_after_infra_failure"] == len(lost), summary
    assert {a["harness"] for a in attempts} == set(HARNESSES), attempts
    return summary, attempts, lost


def test_smoke_run_on_ray_survives_a_dead_rollout_node(tmp_path: Path) -> None:
    out = tmp_path / "ray-smoke"
    # Two passes over the 4 smoke tasks: groups lost to the dead node still leave two steps' worth.
    run = _start(
        out,
        "scheduler.ray.local_sandbox_nodes=2",
        "scheduler.ray.local_sandbox_slots=2",
        "scheduler.passes=2",
    )
    try:
        agent = _wait_for_agent(run, out)
        info = json.loads((out / CLUSTER_FILE).read_text())
        # The rollout node running this agent: the raylet among the agent's ancestors.
        victim = next(n for n in info["sandbox_nodes"] if n["raylet_pid"] in _ancestors(agent))
        os.kill(victim["raylet_pid"], signal.SIGKILL)
        assert run.wait(timeout=1200) == 0, _log(out)
    finally:
        if run.poll() is None:
            run.kill()
    summary, attempts, lost = _finished_despite_a_lost_node(out)
    assert any("NodeDiedError" in a["error"] or "WorkerCrashedError" in a["error"] for a in lost), lost
    sandbox_ids = {n["node_id"] for n in info["sandbox_nodes"]}
    sessions = {}  # attempt id -> the proxy's session folder (meta.json + calls.jsonl)
    for meta in (out / "records" / "sessions").glob("*/meta.json"):
        sessions[json.loads(meta.read_text())["metadata"].get("attempt")] = meta.parent
    graded = [a for a in attempts if a["reward"] is not None]
    assert graded, attempts
    for a in graded:
        placement = json.loads(
            next((out / "attempts").rglob(f"{a['attempt_id']}/{PLACEMENT_FILE}")).read_text()
        )
        assert placement["node_id"] in sandbox_ids and placement["node_id"] != info["head"]["node_id"]
        calls = (sessions[a["attempt_id"]] / "calls.jsonl").read_text().splitlines()
        assert len(calls) == a["model_calls"] >= 1, f"the proxy's records of {a['attempt_id']}"
        assert "correctness" in a["reward_terms"], a
    assert sum(a["rows"] for a in graded) >= summary["rows_trained"] > 0
    # The in-training evaluation's attempts ran on the cluster too (grading in the driver).
    evaluated = [json.loads(p.read_text())["node_id"] for p in (out / "eval").rglob(PLACEMENT_FILE)]
    assert evaluated and set(evaluated) <= sandbox_ids, evaluated
    assert not _raylets_of(info["temp_dir"]) and not Path(info["temp_dir"]).exists()
    assert not run_processes(out)


def test_sigterm_of_a_ray_run_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "ray-term"
    run = _start(out, "trainer.max_steps=50")
    try:
        _wait_for_agent(run, out)
        info = json.loads((out / CLUSTER_FILE).read_text())
        assert _raylets_of(info["temp_dir"])
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=180) == 128 + signal.SIGTERM, _log(out)
    finally:
        if run.poll() is None:
            run.kill()
    deadline = time.monotonic() + 20
    while (run_processes(out) or _raylets_of(info["temp_dir"])) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not run_processes(out), "processes of the stopped run are still alive"
    assert not _raylets_of(info["temp_dir"]), "Ray processes of the run's cluster are still alive"
    assert not Path(info["temp_dir"]).exists(), "the run's Ray session folders were left behind"


def test_sigkill_of_a_ray_run_leaves_no_process_and_a_rerun_clears_its_folder(tmp_path: Path) -> None:
    out = tmp_path / "ray-kill"
    run = _start(out, "trainer.max_steps=50")
    try:
        _wait_for_agent(run, out)
        info = json.loads((out / CLUSTER_FILE).read_text())
    finally:
        run.send_signal(signal.SIGKILL)  # the run alone, as the OOM killer would
        run.wait(timeout=60)
    # Ray's reaper ends the nodes at once; a worker the raylet was starting as they died notices it
    # only at its own connection timeout (about 60 s, measured).
    deadline = time.monotonic() + 90
    while (run_processes(out) or _raylets_of(info["temp_dir"])) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _raylets_of(info["temp_dir"]), "Ray processes of the SIGKILLed run's cluster are alive"
    assert not run_processes(out), "processes of the SIGKILLed run are alive"
    # Its session folder is left to the next run on the same output folder, which removes it.
    from fineenvs.rollout.ray_backend import _remove_stale_temp_dir

    _remove_stale_temp_dir(out)
    assert not Path(info["temp_dir"]).exists()


def _marked_under(out: Path, raylets: set[int]) -> int | None:
    """A process of the run's attempts (it carries an attempt marker) started by one of ``raylets``:
    with the docker sandbox, the ``docker run`` client or the guard (the agent itself runs under
    the container runtime, not under Ray)."""
    for pid in attempt_processes(out):
        hit = _ancestors(pid) & raylets
        if hit:
            return hit.pop()
    return None


def test_smoke_run_on_ray_in_containers_survives_a_dead_rollout_node(tmp_path: Path) -> None:
    """``scheduler.backend=ray scheduler.sandbox=docker``: each attempt a Ray task on a rollout node
    that runs the agent in a container; one rollout node is killed while its attempts' containers
    run. The run finishes its two steps; the lost attempts are infrastructure failures; every graded
    attempt ran on a rollout node, in a container; no container, Ray or run process is left."""
    from fineenvs.harnesses import container as ct

    problem = ct.daemon_problem()
    assert problem is None, f"this test needs a Docker daemon (make test-ray starts one): {problem}"
    out = tmp_path / "ray-docker"
    rid = ct.run_id(str(out))
    run = _start(
        out,
        "scheduler.sandbox=docker",
        "scheduler.ray.local_sandbox_nodes=2",
        "scheduler.ray.local_sandbox_slots=2",
        "scheduler.passes=2",
    )
    try:
        deadline = time.monotonic() + 900
        while True:
            assert run.poll() is None, "the run ended before a container started: " + _log(out)
            assert time.monotonic() < deadline, (
                "no attempt in a container on a rollout node within 15 minutes"
            )
            if (out / CLUSTER_FILE).is_file() and ct.run_containers(rid):
                info = json.loads((out / CLUSTER_FILE).read_text())
                raylets = {n["raylet_pid"] for n in info["sandbox_nodes"]}
                victim = _marked_under(out, raylets)
                if victim is not None:
                    break
            time.sleep(0.2)
        os.kill(victim, signal.SIGKILL)
        assert run.wait(timeout=1500) == 0, _log(out)
    finally:
        if run.poll() is None:
            run.kill()
    _, attempts, _ = _finished_despite_a_lost_node(out)
    graded = [a for a in attempts if a["reward"] is not None]
    assert graded, attempts
    sandbox_ids = {n["node_id"] for n in info["sandbox_nodes"]}
    for a in graded:
        folder = next((out / "attempts").rglob(f"{a['attempt_id']}/{PLACEMENT_FILE}")).parent
        assert json.loads((folder / PLACEMENT_FILE).read_text())["node_id"] in sandbox_ids
        record = json.loads((folder / "attempt.json").read_text())
        assert record["container"] and record["argv"][1] == "run", record["argv"][:3]
    # The guards of the dead node's attempts removed their containers; the run removed the rest.
    assert ct.run_containers(rid) == []
    assert not _raylets_of(info["temp_dir"]) and not run_processes(out)
