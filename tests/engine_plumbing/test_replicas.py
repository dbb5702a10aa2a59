"""The replica set's fan-out: one push reaches every serving replica, all or nothing.

The replicas here are ``Recorder``s (vLLM's dev routes over an in-memory transport) and the router
is ``FakeRouter``, a fake that records ``/add_worker`` and ``/remove_worker`` as vllm-router takes
them; the real router and real servers are in ``test_router.py`` and the vLLM tier."""

from __future__ import annotations

import itertools
import socket
import threading
import time
from pathlib import Path
from types import TracebackType

import httpx
import pytest

from engine_plumbing.test_weight_sync import Recorder, state_dict
from fineenvs.engine.replicas import Replica, ReplicaSet
from fineenvs.engine.weights import VLLMReloadWeightSync, WeightSyncError

TICKS = itertools.count()
"""One clock for every replica and the router, to check the order of calls across them."""


class TimedRecorder(Recorder):
    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.ticks: list[tuple[int, str]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.ticks.append((next(TICKS), request.url.path))
        return super().__call__(request)


class FakeRouter:
    """Fake of vllm-router's worker registry (``RouterHandle``'s two calls), with the time of each."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = list(urls)
        self.events: list[tuple[int, str, str]] = []
        self.lock = threading.Lock()

    def add_worker(self, url: str) -> None:
        with self.lock:
            self.events.append((next(TICKS), "add", url))
            self.urls.append(url)

    def remove_worker(self, url: str) -> None:
        with self.lock:
            self.events.append((next(TICKS), "remove", url))
            self.urls.remove(url)


def replica_set(
    tmp_path: Path, n: int, *, fail: dict[int, str] | None = None, attached: bool = False
) -> tuple[ReplicaSet, list[TimedRecorder], FakeRouter]:
    recorders = [TimedRecorder(fail=(fail or {}).get(i)) for i in range(n)]
    replicas = [
        Replica(
            name=f"r{i}",
            url=f"http://replica-{i}",
            sync=VLLMReloadWeightSync(f"http://replica-{i}", tmp_path / "staged", client=rec.client()),
            relaunch=None if attached else (lambda: pytest.fail("no restart expected here")),
        )
        for i, rec in enumerate(recorders)
    ]
    router = FakeRouter([r.url for r in replicas])
    return ReplicaSet(replicas, router, log=lambda line: None), recorders, router  # type: ignore[arg-type]


def first(rec: TimedRecorder, path: str) -> int:
    return next(t for t, p in rec.ticks if p == path)


def test_a_push_pauses_and_installs_on_every_replica_before_any_resumes(tmp_path: Path) -> None:
    replicas, recorders, router = replica_set(tmp_path, 4)
    assert replicas.push(state_dict(), 3) == 3
    for rec in recorders:
        assert rec.paths == [
            "/pause", "/collective_rpc", "/update_weight_version", "/reset_prefix_cache", "/resume", "/weight_info"
        ]  # fmt: skip
        assert rec.version == "3"
    # No replica serves version 3 while another still serves the previous weights.
    last_install = max(first(rec, "/reset_prefix_cache") for rec in recorders)
    assert all(first(rec, "/resume") > last_install for rec in recorders)
    # One staged copy: every replica reloads the same folder.
    paths = {rec.calls[1][3]["kwargs"]["weights_path"] for rec in recorders}
    assert len(paths) == 1 and (Path(paths.pop()) / "model.safetensors").is_file()
    assert router.events == [] and replicas.serving_urls() == router.urls
    replicas.close()


def test_a_replica_that_fails_its_push_leaves_routing_before_the_others_resume(tmp_path: Path) -> None:
    replicas, recorders, router = replica_set(tmp_path, 3, fail={1: "/collective_rpc"})
    assert replicas.push(state_dict(), 5) == 5
    broken = recorders[1]
    assert "/resume" not in broken.paths, "a replica with partly loaded weights must not serve"
    (removed_at, what, url) = router.events[0]
    assert (what, url) == ("remove", "http://replica-1")
    assert all(first(rec, "/resume") > removed_at for rec in (recorders[0], recorders[2]))
    assert [r.url for r in replicas.serving()] == ["http://replica-0", "http://replica-2"] == router.urls
    assert recorders[0].version == recorders[2].version == "5"
    assert (
        "collective_rpc" in replicas.replicas[1].failures[0] or "reload" in replicas.replicas[1].failures[0]
    )
    replicas.close()


def test_an_attached_replica_that_fails_stops_the_run(tmp_path: Path) -> None:
    replicas, recorders, router = replica_set(tmp_path, 2, fail={0: "/pause"}, attached=True)
    with pytest.raises(
        WeightSyncError, match=r"engine\.urls.*cannot be restarted.*resumes from its last checkpoint"
    ):
        replicas.push(state_dict(), 2)
    assert router.urls == ["http://replica-1"]
    assert recorders[0].paths[-1] == "/resume", "a server someone else runs is not left paused"
    replicas.close()


class FakeLaunch:
    """Fake of ``EngineLaunch`` for a restart: nothing runs; it records entering and leaving."""

    process = None

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def __enter__(self) -> FakeLaunch:
        self.log.append("started")
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.log.append("stopped")


def test_a_restarted_replica_gets_the_current_weights_before_it_is_routed_to(tmp_path: Path) -> None:
    replicas, recorders, router = replica_set(tmp_path, 2)
    replicas.push(state_dict(), 4)
    fresh = TimedRecorder()
    launches: list[str] = []
    victim = replicas.replicas[0]
    victim.launch = FakeLaunch(launches)  # type: ignore[assignment]
    victim.relaunch = lambda: (  # type: ignore[assignment]
        FakeLaunch(launches),
        VLLMReloadWeightSync(victim.url, tmp_path / "staged", client=fresh.client()),
    )
    with replicas._lock:
        replicas._take_out(victim, "killed by the test")
    assert router.urls == ["http://replica-1"]
    replicas._restart(victim)
    assert launches == ["stopped", "started"]
    assert fresh.paths == ["/collective_rpc", "/update_weight_version", "/reset_prefix_cache", "/weight_info"]
    assert fresh.version == "4"
    added_at = router.events[-1][0]
    assert router.events[-1][1:] == ("add", "http://replica-0")
    assert all(t < added_at for t, _ in fresh.ticks), "routed to before it held version 4"
    assert victim.serving and victim.restarts == 1
    replicas.close()


def test_replica_devices_split_in_order_and_refuse_what_does_not_fit() -> None:
    from fineenvs.engine.devices import DeviceError, parse_core_list, per_replica, split_cores

    assert per_replica(("0", "1", "2", "3"), 2) == [("0", "1"), ("2", "3")]
    with pytest.raises(DeviceError, match=r"do not split into 3 replicas.*Fix: engine\.replicas"):
        per_replica(("0", "1", "2", "3"), 3)
    assert split_cores([0, 1, 2, 3, 4], 2) == ["0,1", "2,3"]
    with pytest.raises(DeviceError, match=r"engine\.replicas=3 on the CPU needs a core per replica.*Fix"):
        split_cores([0, 1], 3)
    assert parse_core_list("0-2, 6") == [0, 1, 2, 6]
    with pytest.raises(ValueError, match="not a core or a range"):
        parse_core_list("3-1")


def test_replica_settings_are_checked_at_compose_time() -> None:
    """Several servers need vLLM, one way to get them, a weight sync that stages once, and cores
    that do not overlap; each refusal names the fix."""
    from hydra import compose, initialize_config_dir

    from fineenvs.config import ConfigError, to_run_config
    from fineenvs.paths import CONF_DIR

    def problems(*overrides: str) -> str:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=["+experiment=smoke", "output_dir=/tmp/x", *overrides])
        try:
            to_run_config(cfg)
        except ConfigError as err:
            return str(err)
        return ""

    assert problems("engine=vllm", "engine.replicas=2") == ""
    assert "engine=transformers runs one process" in problems("engine.replicas=2")
    assert "set only one of them" in problems("engine=vllm", "engine.replicas=2", "engine.urls=[http://a:1]")
    assert "engine.url attaches one server" in problems(
        "engine=vllm", "engine.replicas=2", "engine.url=http://a:1"
    )
    assert "replicas are not supported with it yet" in problems(
        "engine=vllm", "engine.replicas=2", "engine.weight_sync=nccl", "engine.platform=cuda"
    )
    assert "one per replica" in problems("engine=vllm", "engine.replicas=2", "engine.replica_cpus=[0]")
    assert "gives core 1 to replicas 0 and 1" in problems(
        "engine=vllm", "engine.replicas=2", "engine.replica_cpus=[0-1,1-2]"
    )
    assert "engine.replicas must be >= 1" in problems("engine=vllm", "engine.replicas=0")


class HungServer:
    """A real TCP server that accepts connections and never answers: a stopped or deadlocked
    replica, as its clients see it (the kernel still completes the handshake)."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.listener.close()
        for conn in self.held:
            conn.close()


def test_a_hung_replica_costs_a_push_one_control_timeout_and_leaves_routing(tmp_path: Path) -> None:
    hung = HungServer()
    healthy = [TimedRecorder(), TimedRecorder()]
    replicas = [
        Replica(
            name=f"r{i}",
            url=f"http://replica-{i}",
            sync=VLLMReloadWeightSync(f"http://replica-{i}", tmp_path / "staged", client=rec.client()),
            relaunch=lambda: pytest.fail("the watcher is not running here"),
        )
        for i, rec in enumerate(healthy)
    ]
    replicas.append(
        Replica(
            name="r2",
            url=hung.url,
            sync=VLLMReloadWeightSync(hung.url, tmp_path / "staged", control_timeout_s=0.5),
            relaunch=lambda: pytest.fail("the watcher is not running here"),
        )
    )
    router = FakeRouter([r.url for r in replicas])
    replica_set = ReplicaSet(replicas, router, log=lambda line: None)  # type: ignore[arg-type]
    started = time.monotonic()
    try:
        assert replica_set.push(state_dict(), 6) == 6
        took = time.monotonic() - started
    finally:
        hung.close()
    # One pause timeout (0.5 s) plus the error's two /health probes (0.5 s each), not the 30 min
    # loading timeout: the push goes on without the hung replica.
    assert took < 10.0, f"the push waited {took:.1f} s on a hung replica"
    assert router.urls == ["http://replica-0", "http://replica-1"]
    assert [rec.version for rec in healthy] == ["6", "6"]
    assert "no answer within 0.5 s" in replicas[2].failures[0]
    assert "pause" in replicas[2].failures[0]
    replica_set.close()
