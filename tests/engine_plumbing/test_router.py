"""vLLM's real router (vllm-router 0.1.17) in front of real embedded engines (tiny_qwen).

Each engine names itself with ``serve --replica-name``; which replica answered is read from
``REPLICA_HEADER`` on the response the router passed through. The router comes from
``python -m fineenvs.engine install-router`` (``make test-vllm`` runs it); without it the tests
fail with that command, as the rest of the vllm tier does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from engine_plumbing.test_launcher import alive
from fineenvs.engine.launcher import Launched, free_port
from fineenvs.engine.router import (
    REPLICA_HEADER,
    SESSION_HEADER,
    RouterError,
    RouterHandle,
    RouterOptions,
    attach_router,
    launch_router,
    router_problem,
)

pytestmark = pytest.mark.vllm

OPTIONS = RouterOptions()
SESSIONS = [f"sess-{i}" for i in range(16)]


def replica(name: str, log_dir: Path) -> tuple[Launched, str]:
    """An embedded engine that stamps ``REPLICA_HEADER: name``, not yet started."""
    port = free_port()
    cmd = [sys.executable, "-m", "fineenvs.engine", "serve", "--model", "tiny_qwen"]
    cmd += ["--port", str(port), "--replica-name", name, "--max-batch-size", "1"]
    url = f"http://127.0.0.1:{port}"
    return Launched(cmd, base_url=url, log_path=log_dir / f"engine-{name}.log", timeout_s=300, name=name), url


def call(router: RouterHandle, session: str, stream: bool = False) -> httpx.Response:
    body = {
        "model": "tiny_qwen",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "temperature": 0.0,
        "stream": stream,
    }
    return httpx.post(
        router.url + "/v1/chat/completions", json=body, headers={SESSION_HEADER: session}, timeout=60
    )


def served_by(router: RouterHandle, session: str) -> str:
    response = call(router, session)
    assert response.status_code == 200, response.text
    return response.headers[REPLICA_HEADER]


def placement(router: RouterHandle, sessions: list[str]) -> dict[str, str]:
    return {s: served_by(router, s) for s in sessions}


def until(predicate: Callable[[], bool], timeout_s: float) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, f"not true within {timeout_s} s"
        time.sleep(0.1)
    return time.monotonic() - start


@pytest.fixture(scope="module")
def started(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RouterHandle, dict[str, str]]]:
    problem = router_problem(OPTIONS)
    if problem:
        pytest.fail(f"the vllm tier needs vLLM's router: {problem}")
    log_dir = tmp_path_factory.mktemp("router")
    pids: list[int] = []
    with ExitStack() as stack:
        urls = {}
        for name in ("A", "B"):
            launch, urls[name] = replica(name, log_dir)
            pids.append(stack.enter_context(launch).pid)
        start = time.monotonic()
        router = stack.enter_context(launch_router(OPTIONS, [urls["A"], urls["B"]], log_dir))
        print(f"router answered {router.url}/readiness after {time.monotonic() - start:.2f} s")
        assert router.pid is not None
        pids.append(router.pid)
        yield router, urls
    assert not [p for p in pids if alive(p)], "a router or engine process outlived its block"
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    assert not [
        line for line in ps.splitlines() if router.url.rsplit(":", 1)[1] in line and "vllm-router" in line
    ]


def test_a_session_stays_on_one_replica_and_sessions_spread(
    started: tuple[RouterHandle, dict[str, str]],
) -> None:
    router, _ = started
    seen = {s: {served_by(router, s) for _ in range(3)} for s in SESSIONS}
    assert all(len(names) == 1 for names in seen.values()), seen
    assert {n for names in seen.values() for n in names} == {"A", "B"}, seen
    # The embedded engine refuses stream=true (the proxy never streams from it); the refusal still
    # names its replica, through the router. Streamed responses: test_router_unit, and vLLM.
    refused = call(router, SESSIONS[0], stream=True)
    assert refused.status_code == 400 and "stream=true" in refused.text, refused.text
    assert refused.headers[REPLICA_HEADER] == next(iter(seen[SESSIONS[0]]))
    # Without the session header every call lands on one replica (0.1.17 does not read the body).
    keyless = {
        httpx.post(
            router.url + "/v1/chat/completions",
            json={"model": "tiny_qwen", "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 1},
            timeout=60,
        ).headers[REPLICA_HEADER]
        for i in range(6)
    }
    assert len(keyless) == 1


def test_remove_and_add_move_only_that_replicas_sessions(
    started: tuple[RouterHandle, dict[str, str]],
) -> None:
    router, urls = started
    before = placement(router, SESSIONS)
    router.remove_worker(urls["B"])
    assert [w["url"] for w in router.workers()] == [urls["A"]]
    assert router.worker_urls == [urls["A"]]
    assert set(placement(router, SESSIONS).values()) == {"A"}
    with pytest.raises(RouterError, match="not a replica"):
        router.remove_worker(urls["B"])
    router.add_worker(urls["B"])
    assert sorted(w["url"] for w in router.workers()) == sorted(urls.values())
    # The ring depends on the set of replicas only: everything is back where it was.
    assert placement(router, SESSIONS) == before
    attached = attach_router(router.url)
    assert sorted(attached.worker_urls) == sorted(urls.values())


def test_a_killed_replica_is_marked_unhealthy_and_its_sessions_move(
    started: tuple[RouterHandle, dict[str, str]], tmp_path: Path
) -> None:
    router, urls = started
    launch, c_url = replica("C", tmp_path)
    with launch as proc:
        start = time.monotonic()
        router.add_worker(c_url)
        print(f"add_worker of a serving replica took {time.monotonic() - start:.2f} s")
        before = placement(router, SESSIONS)
        on_c = [s for s, name in before.items() if name == "C"]
        assert on_c, before
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        # Retries are off: the next call of C's session fails where the caller sees it, at once,
        # instead of being re-run on another replica.
        failed = call(router, on_c[0])
        assert failed.status_code >= 500, (failed.status_code, failed.headers, failed.text)
        print(f"call right after the kill: {failed.status_code} {failed.text[:120]}")
        interval = OPTIONS.health_check_interval_s

        def c_unhealthy() -> bool:
            return any(w["url"] == c_url and not w["is_healthy"] for w in router.workers())

        took = until(c_unhealthy, timeout_s=(OPTIONS.health_failure_threshold + 3) * interval + 5)
        print(f"killed replica marked unhealthy after {took:.2f} s (interval {interval} s)")
        after = placement(router, SESSIONS)
        assert {after[s] for s in on_c} <= {"A", "B"}, after
        assert all(after[s] == before[s] for s in SESSIONS if s not in on_c), (before, after)
        router.remove_worker(c_url)
    assert sorted(router.worker_urls) == sorted(urls.values())
