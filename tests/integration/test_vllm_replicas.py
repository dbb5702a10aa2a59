"""``engine.replicas=2`` end to end: two real vLLM CPU-build servers behind the real vllm-router,
the smoke job with two real agent CLIs and five optimizer steps, and one replica SIGKILLed once
it has served a call, restarted by the run with the current weights while it goes on.

What it shows: every call of a session reaches one replica while that replica lives; each push
reaches every serving replica (the parity gate scores each); a restarted replica serves the
current version, never an older one; the run finishes."""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from fineenvs.engine.router import RouterOptions, router_executable
from fineenvs.harnesses import check_installed
from fineenvs.lifecycle import run_processes
from fineenvs.paths import REPO_ROOT
from tests.engine_plumbing.vllm_helpers import build_python

pytestmark = pytest.mark.vllm

HARNESSES = ["opencode", "mini_swe_agent"]


def _replica_group(name: str) -> int | None:
    """The process group of the vLLM server started as replica ``name`` (its FINEENVS_REPLICA)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if f"FINEENVS_REPLICA={name}".encode() in env and b"serve" in cmdline:
            return os.getpgid(int(proc.name))
    return None


def _served_by(out: Path, replica: str) -> bool:
    needle = f'"replica":"{replica}"'.encode()
    return any(needle in f.read_bytes() for f in (out / "records" / "sessions").glob("*/calls.jsonl"))


def _sessions(out: Path) -> dict[str, list[dict[str, Any]]]:
    from fineenvs.proxy.store import CallStore

    store = CallStore(out / "records")
    return {s.name: store.read_session(s.name) for s in sorted((out / "records" / "sessions").iterdir())}


def test_two_replicas_behind_the_router_survive_a_sigkilled_replica(tmp_path: Path) -> None:
    problems = check_installed(HARNESSES)
    if problems:
        pytest.fail("the run needs its agent CLIs: " + "; ".join(problems))
    build_python("cpu")
    if router_executable(RouterOptions()) is None:
        pytest.fail("vllm-router is not installed: python -m fineenvs.engine install-router")
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "fineenvs.run", "+experiment=smoke", "engine=vllm", "engine.replicas=2",
        f"harness=[{','.join(HARNESSES)}]", "trainer.max_steps=5", "tasks.limit=5", "trainer.learning_rate=1e-2",
        "trainer.weight_decay=0.5", f"hydra.run.dir={out}",
    ]  # fmt: skip
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    log = open(tmp_path / "run.log", "w")  # noqa: SIM115 - read after the run
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    killed_at = None
    try:
        # Kill r1 as soon as it has served a call (sessions spread by a hash of their random ids, so
        # which replica the first ones reach is chance), early enough that its restart is done before
        # the last pushes.
        deadline = time.monotonic() + 1200
        while not _served_by(out, "r1"):
            assert proc.poll() is None, (
                "the run ended before r1 served a call:\n" + (tmp_path / "run.log").read_text()[-4000:]
            )
            assert time.monotonic() < deadline, "no call on r1 within 20 minutes"
            time.sleep(0.5)
        group = _replica_group("r1")
        assert group is not None, "replica r1's vLLM server is not running"
        killed_at = time.time()
        os.killpg(group, signal.SIGKILL)
        rc = proc.wait(timeout=1500)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    text = (tmp_path / "run.log").read_text()
    assert rc == 0, text[-6000:]
    assert "replica r1" in text and "out of routing" in text and "serving again at version" in text, text[
        -6000:
    ]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["weight_pushes"] == 5, summary

    # Every session stays on one replica until r1 is killed; a session moves only with the kill.
    sessions = _sessions(out)
    served: set[str] = set()
    for sid, data in sessions.items():
        calls = sorted(data["calls"], key=lambda c: c["timings"]["arrived_at"])
        replicas = [c["replica"] for c in calls]
        assert all(r in ("r0", "r1") for r in replicas), (sid, replicas)
        served.update(replicas)
        for before, after in itertools.pairwise(calls):
            if before["replica"] != after["replica"]:
                # The call that moved was answered after the kill: sent after it, or in flight on r1
                # when it died and resent to r0 by the proxy (it keeps its arrival time).
                t = after["timings"]
                assert t["arrived_at"] + t["upstream_s"] + t["proxy_s"] >= killed_at, (sid, replicas, t)
        errors = [e for e in data["events"] if e.get("kind") == "upstream_error"]
        # Only a call in flight on the killed replica may fail (the agent got an error reply).
        assert not errors or any(c["replica"] == "r1" for c in calls) or not calls, (sid, errors)
    assert served == {"r0", "r1"}, served

    # The gate scored every serving replica at start and after each push: both before the kill, r0
    # alone while r1 restarted, both again once r1 was back with the current weights.
    checks = [json.loads(line) for line in (out / "parity" / "checks.jsonl").read_text().splitlines()]
    assert [c["version"] for c in checks] == [0, 1, 2, 3, 4, 5] and all(c["ok"] for c in checks), checks
    back_at = int(re.findall(r"replica r1: serving again at version (\d+)", text)[-1])
    assert back_at >= 1, "the restarted replica must get pushed weights, not the base model's"
    after = [c for c in checks if c["version"] > back_at]
    assert checks[0]["replicas"] == 2 and all(c["replicas"] == 2 for c in after), checks
    # Back before the last push (the usual case, not guaranteed on a loaded machine): the gate then
    # found the restarted replica serving the trainer's weights.
    print(f"r1 back at version {back_at}; gate checks of both replicas since: {len(after)}")
    # The restarted r1 got the current weights before it served: none of its calls after the kill
    # carries a version older than what r0 served before the kill.
    calls = [c for data in sessions.values() for c in data["calls"]]
    before_kill = [c["weight_version"] for c in calls if c["timings"]["arrived_at"] < killed_at]
    restarted = [
        c["weight_version"]
        for c in calls
        if c["replica"] == "r1" and c["timings"]["arrived_at"] > killed_at + 5
    ]
    assert all(v is not None and v >= max(v for v in before_kill if v is not None) for v in restarted), (
        before_kill,
        restarted,
    )
    assert not run_processes(out), "processes of the run are still alive"


def _start_commands(urls: list[str]) -> list[tuple[dict[str, str], list[str]]]:
    """The serve commands the dry run tells a user to start for ``engine.urls`` (env, argv)."""
    listing = subprocess.run(
        [sys.executable, "-m", "fineenvs.run", "+experiment=smoke", "engine=vllm", f"engine.urls=[{','.join(urls)}]",
         "dry_run=true"],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    commands = []
    for line in listing.splitlines():
        if not line.strip().startswith("FINEENVS_REPLICA="):
            continue
        words = shlex.split(line.strip())
        env = dict(
            w.split("=", 1) for w in itertools.takewhile(lambda w: "=" in w and not w.startswith("-"), words)
        )
        commands.append((env, words[len(env) :]))
    assert len(commands) == len(urls), listing
    return commands


def test_servers_the_user_runs_are_driven_through_engine_urls(tmp_path: Path) -> None:
    """``engine.urls``: two vLLM servers started by hand from the commands the dry run prints, the
    smoke job with two real agents and two steps through a router the run launches. The run pushes
    to both, leaves both running and serving (not paused) at the last version, and stops nothing
    it did not start."""
    from fineenvs.engine.launcher import free_port
    from fineenvs_recipes.tiny import ensure_tiny_model

    problems = check_installed(HARNESSES)
    if problems:
        pytest.fail("the run needs its agent CLIs: " + "; ".join(problems))
    build_python("cpu")
    ensure_tiny_model("tiny_agent")
    urls = [f"http://127.0.0.1:{free_port('127.0.0.1')}" for _ in range(2)]
    servers = []
    try:
        for i, (env, argv) in enumerate(_start_commands(urls)):
            log = open(tmp_path / f"server-{i}.log", "w")  # noqa: SIM115 - closed with the process
            servers.append(
                subprocess.Popen(argv, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
            )  # fmt: skip
        deadline = time.monotonic() + 900
        for url, server in zip(urls, servers, strict=True):
            while True:
                assert server.poll() is None, (tmp_path / f"server-{servers.index(server)}.log").read_text()[
                    -3000:
                ]
                assert time.monotonic() < deadline, f"{url} not healthy within 15 minutes"
                try:
                    if httpx.get(url + "/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(1)
        out = tmp_path / "run"
        cmd = [
            sys.executable, "-m", "fineenvs.run", "+experiment=smoke", "engine=vllm", f"engine.urls=[{','.join(urls)}]",
            f"harness=[{','.join(HARNESSES)}]", "trainer.max_steps=2", "tasks.limit=4", f"hydra.run.dir={out}",
        ]  # fmt: skip
        env = dict(os.environ, WANDB_MODE="disabled", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
        done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1500)
        assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["steps"] == 2 and summary["weight_pushes"] == 2, summary

        # Still running, serving and at the run's last version: a push reached both, and the run
        # stopped only what it started (the router).
        for url, server in zip(urls, servers, strict=True):
            assert server.poll() is None, f"the run stopped {url}, which it did not start"
            assert httpx.get(url + "/weight_info", timeout=10).json()["weight_version"] == "2"
            reply = httpx.post(
                url + "/v1/chat/completions",
                json={
                    "model": "tiny_agent",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2,
                },
                timeout=60,
            )
            assert reply.status_code == 200 and reply.json()["choices"], reply.text
        sessions = _sessions(out)
        served = {c["replica"] for data in sessions.values() for c in data["calls"]}
        assert served <= {"r0", "r1"} and served, served
        for sid, data in sessions.items():
            assert len({c["replica"] for c in data["calls"]}) <= 1, (
                sid,
                [c["replica"] for c in data["calls"]],
            )
        checks = [json.loads(line) for line in (out / "parity" / "checks.jsonl").read_text().splitlines()]
        assert [c["version"] for c in checks] == [0, 1, 2] and all(
            c["ok"] and c["replicas"] == 2 for c in checks
        )
        assert not run_processes(out), "processes of the run are still alive"
    finally:
        for server in servers:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGTERM)
        for server in servers:
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
