"""``serve --workers N``: sessions sharded over proxy processes, the control plane in the main one.

The real proxy command runs in front of the benchmark's engine stand-in (a raw HTTP server whose
replies carry vLLM-shaped token ids), and the official ``openai`` SDK makes the model calls.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from processes import stop, wait_ok

from benchmarks.common import SAMPLED, child_pids, free_port, free_ports
from fineenvs.paths import REPO_ROOT
from fineenvs.proxy.sessions import shard_of
from fineenvs.proxy.settings import ProxySettings, SamplingPolicy
from fineenvs.proxy.workers import settings_from_json, settings_to_json

PY = sys.executable


def test_shard_of_is_stable_and_spreads() -> None:
    ids = [f"s{i:04d}" for i in range(3000)]
    shards = [shard_of(i, 4) for i in ids]
    assert shards == [shard_of(i, 4) for i in ids]  # no per-process salt (unlike hash())
    counts = [shards.count(k) for k in range(4)]
    assert min(counts) > 600, counts
    assert {shard_of(i, 1) for i in ids} == {0}


def test_worker_settings_round_trip_exactly() -> None:
    s = ProxySettings(
        upstream_url="http://127.0.0.1:9",
        served_model="m",
        store_dir="/tmp/x",
        sampling=SamplingPolicy(temperature=0.6, top_k=5),
        workers=3,
        fsync=False,
    )
    assert settings_from_json(settings_to_json(s)) == s


def test_workers_setting_is_validated() -> None:
    with pytest.raises(ValueError, match="workers=0 must be between 1 and 64"):
        ProxySettings(workers=0).validate()


@pytest.fixture
def standin() -> Iterator[int]:
    port = free_port()
    proc = subprocess.Popen([PY, "-m", "benchmarks.servers", "standin", "--port", str(port)], cwd=REPO_ROOT)
    try:
        wait_ok(f"http://127.0.0.1:{port}/health")
        yield port
    finally:
        stop(proc)


def _serve(engine: int, port: int, store: Path, workers: int = 3) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [PY, "-m", "fineenvs.proxy", "serve", "--engine-url", f"http://127.0.0.1:{engine}",
         "--served-model", "standin", "--port", str(port), "--store-dir", str(store),
         "--workers", str(workers)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    wait_ok(f"http://127.0.0.1:{port}/health")
    return proc


def _chat(base_url: str, key: str, text: str) -> Any:
    client = openai.OpenAI(
        base_url=f"{base_url}/v1", api_key="ignored-the-path-carries-the-key", max_retries=0
    )
    return client.chat.completions.create(
        model="agent-asks-this", messages=[{"role": "user", "content": text}]
    )


def _port_base(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def test_sessions_shard_over_workers_and_control_plane_sees_all(standin: int, tmp_path: Path) -> None:
    port = free_ports(3)
    main = _serve(standin, port, tmp_path / "store")
    base = _port_base(port)
    try:
        health = httpx.get(f"{base}/health").json()
        assert health["status"] == "ok" and [w["port"] for w in health["workers"]] == [port + 1, port + 2]
        # Session ids are random, so 12 sessions miss a shard about 2 % of the time; draw until
        # every shard owns one (at least 12, at most 60: a miss then has odds of ~1e-10).
        sessions: list[dict] = []
        while len(sessions) < 12 or ({s["shard"] for s in sessions} != {0, 1, 2} and len(sessions) < 60):
            sessions.append(httpx.post(f"{base}/sessions", json={"task": f"t{len(sessions)}"}).json())
        shards = {s["shard"] for s in sessions}
        assert shards == {0, 1, 2}, shards
        for s in sessions:
            assert s["shard"] == shard_of(s["session_id"], 3)
            assert s["base_url"] == f"http://127.0.0.1:{port + s['shard']}/s/{s['key']}"
            reply = _chat(s["base_url"], s["key"], f"hello {s['session_id']}")
            assert reply.choices[0].message.content == "Done: the files are listed."
            assert reply.model == "agent-asks-this"
        for s in sessions:
            r = httpx.get(f"{base}/sessions/{s['session_id']}/rollout")
            assert r.status_code == 200, r.text
            (call,) = r.json()["calls"]
            assert r.json()["session"]["metadata"]["task"] == s["metadata"]["task"]
            assert call["sampled_ids"] == SAMPLED and call["logprobs_aligned"] is True
            assert call["logprobs"] == [-0.25] * len(SAMPLED) and len(call["prompt_ids"]) > 0
            stats = httpx.get(f"{base}/sessions/{s['session_id']}").json()
            assert stats["recorded_calls"] == 1
        listed = httpx.get(f"{base}/sessions").json()["sessions"]
        assert sorted(x["session_id"] for x in listed) == sorted(s["session_id"] for s in sessions)
        # A user-chosen id lands on its one possible owner, which refuses a duplicate.
        first = httpx.post(f"{base}/sessions", json={"session_id": "mine-1"})
        assert first.status_code == 201 and first.json()["shard"] == shard_of("mine-1", 3)
        again = httpx.post(f"{base}/sessions", json={"session_id": "mine-1"})
        assert again.status_code == 400 and "taken" in again.json()["error"]
        # Closing through the main process closes it in its worker: the key stops working there.
        foreign = next(s for s in sessions if s["shard"] != 0)
        r = httpx.delete(f"{base}/sessions/{foreign['session_id']}")
        assert r.status_code == 200 and r.json()["closed"] is True
        with pytest.raises(openai.AuthenticationError):
            _chat(foreign["base_url"], foreign["key"], "after close")
        # Worker control routes need the pool's internal key, even on loopback.
        r = httpx.get(f"{_port_base(port + 1)}/sessions")
        assert r.status_code == 401
        assert httpx.get(f"{base}/sessions/nope").status_code == 404
    finally:
        stop(main)
    assert main.returncode is not None
    deadline = time.monotonic() + 10
    while child_pids(main.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not child_pids(main.pid)


def test_killed_worker_is_restarted_and_loses_no_recorded_call(standin: int, tmp_path: Path) -> None:
    port = free_ports(2)
    store = tmp_path / "store"
    main = _serve(standin, port, store, workers=2)
    base = _port_base(port)
    try:
        s = next(
            s for s in (httpx.post(f"{base}/sessions", json={}).json() for _ in range(40)) if s["shard"] == 1
        )
        for i in range(3):
            _chat(s["base_url"], s["key"], f"call {i}")
        (worker,) = child_pids(main.pid)
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 90
        while True:
            health = httpx.get(f"{base}/health").json()
            if health["workers"][0]["restarts"] == 1 and health["workers"][0]["alive"]:
                break
            assert time.monotonic() < deadline, health
            time.sleep(0.2)
        wait_ok(f"{_port_base(port + 1)}/health")
        reply = _chat(s["base_url"], s["key"], "after the crash")  # same base_url, same key
        assert reply.choices[0].message.content
        calls = httpx.get(f"{base}/sessions/{s['session_id']}/rollout").json()["calls"]
        assert [c["index"] for c in calls] == [0, 1, 2, 3]
        assert all(c["sampled_ids"] == SAMPLED for c in calls)
        old_workers = child_pids(main.pid)
    finally:
        stop(main)
    _wait_gone(old_workers)  # their sockets must be closed before the ports are bound again
    # The same --port and --workers after a restart: old keys reach their sessions again.
    main = _serve(standin, port, store, workers=2)
    try:
        reply = _chat(s["base_url"], s["key"], "after the restart")
        assert reply.choices[0].message.content
        stats = httpx.get(f"{base}/sessions/{s['session_id']}").json()
        assert stats["recorded_calls"] == 5
        # A main process killed outright takes its workers with it (they watch their parent).
        pids = child_pids(main.pid)
        assert len(pids) == 1
        stop(main, signal.SIGKILL)
        _wait_gone(pids)
    finally:
        stop(main)


def _wait_gone(pids: list[int], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while any(Path(f"/proc/{p}").exists() and _state(p) != "Z" for p in pids):
        assert time.monotonic() < deadline, f"worker processes {pids} outlived their main process"
        time.sleep(0.2)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


@pytest.mark.slow
def test_benchmark_command_runs_with_workers_and_prints_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [PY, "-m", "benchmarks", "proxy", "--workers", "2", "--sessions", "60", "--memory-sessions", "8",
         "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO_ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    for needle in (
        "2 proxy processes",
        "proxy CPU per small call",
        "proxy CPU per large call",
        "records per 17-call attempt",
        "capacity 60 sessions x 2 calls, 3 runs (median): 360/360 done, 0 errors OK",
        "null relay",
        "/health under load",
        "memory 8 sessions",
        "supplementary, engine taking 1000 ms per call",
    ):
        assert needle in text, (needle, text)
    import orjson

    results = orjson.loads(out.read_bytes())["results"]
    cap = results["capacity"]
    assert cap["proxy"]["done"] == cap["relay"]["done"] == cap["direct"]["done"] == 360
    assert len(cap["proxy"]["runs"]) == 3 and cap["proxy"]["throughput"] == sorted(cap["proxy"]["runs"])[1]
    for run in results["latency"]:
        assert 0 < run["small"]["cpu_ms"] < run["large"]["cpu_ms"]
        assert len(run["small"]["proxy"]) == 200 and len(run["large"]["proxy"]) == 34
    assert 1.0 < results["latency"][0]["record"]["ratio"]
    paced = results["paced"]
    assert paced["proxy"]["done"] == paced["direct"]["done"] == 120 and "relay" not in paced
    # 2 calls of 1 s each: neither path can finish faster than the engine allows.
    assert paced["direct"]["throughput"] < 60 * 2 / 2.0 * 1.05


def test_busy_worker_port_falls_back_to_a_free_one(standin: int, tmp_path: Path) -> None:
    import socket

    port = free_ports(2)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port + 1))
        squatter.listen(1)
        main = _serve(standin, port, tmp_path / "store", workers=2)
        try:
            (worker,) = httpx.get(f"{_port_base(port)}/health").json()["workers"]
            assert worker["alive"] and worker["port"] != port + 1
            s = next(
                s
                for s in (httpx.post(f"{_port_base(port)}/sessions", json={}).json() for _ in range(40))
                if s["shard"] == 1
            )
            assert s["base_url"].startswith(f"http://127.0.0.1:{worker['port']}/s/")
            assert _chat(s["base_url"], s["key"], "hi").choices[0].message.content
        finally:
            stop(main)


def test_engine_connections_are_split_over_the_processes() -> None:
    from fineenvs.proxy.workers import share_of_engine

    assert share_of_engine(ProxySettings(max_upstream_concurrency=256, workers=3)) == 85
    assert share_of_engine(ProxySettings(max_upstream_concurrency=2, workers=4)) == 1
    assert share_of_engine(ProxySettings(max_upstream_concurrency=256, workers=1)) == 256
