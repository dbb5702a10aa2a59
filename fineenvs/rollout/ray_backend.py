"""Attempts on a Ray cluster (``scheduler.backend=ray``): each attempt is one Ray task placed by a
resource (``scheduler.ray.sandbox_resource``, default ``sandbox``) on a rollout node.

What is covered:

- The remote side runs ``fineenvs.harnesses.sandbox.run_attempt`` exactly as the local runner
  does (same sandbox kinds, same guard) and returns its ``AttemptResult``, the proxy's record of
  the session and where Ray placed it. Grading, rewards and rows stay with the driver.
- A local cluster started by the run when ``scheduler.ray.address`` is null: a head (no sandbox
  resource) plus ``local_sandbox_nodes`` rollout nodes, through Ray's own ``cluster_utils.Cluster``,
  in a temporary folder of its own (``RAY_TMPDIR``), removed at teardown. Ray's reaper
  fate-shares those processes with this one, so a SIGKILLed run leaves none behind; SIGTERM
  unwinds the runtime and stops them here.
- Faults: a task whose node or worker died, or that Ray could not place or finish within the
  attempt's timeout plus ``placement_timeout_seconds``, is an ``InfrastructureFailure``: reward
  None, ``exit_reason=infra_failure``, counted like any ungraded attempt; never a 0 reward.

What is not covered:

- A rollout node needs the attempt folder the driver grades: ``paths.output_dir`` must be on a
  filesystem every node mounts at the same path, and rollout nodes must reach the proxy at
  ``scheduler.ray.proxy_url`` (both checked at start by one task, ``check_rollout_node``).
- The agent CLIs are found in the node's ``FINEENVS_CACHE`` (shared, or installed there by the
  project's installer on first use; an install needs the node to reach the registries).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from fineenvs.rollout.scheduler import InfrastructureFailure

if TYPE_CHECKING:
    from fineenvs.harnesses.sandbox import AttemptResult
    from fineenvs.jsonl import JsonObject

log = logging.getLogger(__name__)

NODE_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    # A raylet SIGKILLs a dead worker's children by default: that would be the attempt's guard,
    # before it could take its agent down (the agent runs in a session of its own and outlives
    # it). Left alone, the guard gets its parent-death SIGTERM and stops the agent itself.
    "RAY_kill_child_processes_on_worker_exit": "0",
}
"""Environment every rollout node's raylet needs (``ray start`` on a real cluster too: docs/cluster.md)."""

LOOPBACK = "127.0.0.1"
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
"""What keeps a local cluster on loopback: Ray resolves a node's address to the machine's
interface address unless this (its switch for single-machine clusters on Windows and macOS) is off."""

CLUSTER_FILE = "ray_cluster.json"
"""What the run started (node ids, raylet pids, temp folder) in its output directory."""
PLACEMENT_FILE = "placement.json"
"""Where Ray ran an attempt, in the attempt's folder (node id, hostname, worker pid)."""


class SchedulerBackend(enum.Enum):
    """``scheduler.backend``: where attempts run."""

    local = "local"
    ray = "ray"


@dataclass
class RaySettings:
    """``scheduler.ray.*``: where attempts run when ``scheduler.backend=ray``."""

    address: str | None = None
    """An existing cluster (``ray://...`` or ``host:port`` of its head); null: the run starts a
    local cluster of its own and stops it at the end."""
    sandbox_resource: str = "sandbox"
    """Custom resource that rollout nodes advertise (``ray start --resources='{"sandbox": N}'``)."""
    sandbox_per_attempt: float = 1.0
    """Amount of it one attempt holds: a node advertising N of the resource holds N / this attempts at once."""
    placement_timeout_seconds: float = 120.0
    """Beyond the attempt's own timeout: how long a task may wait for a node and a worker before
    it counts as an infrastructure failure (no node with the resource alive never hangs a run)."""
    proxy_url: str | None = None
    """The proxy as rollout nodes reach it (``http://HEAD_IP:PORT``); null: the address the driver
    uses, right for a local cluster. A non-loopback proxy needs ``proxy.host`` and ``proxy.admin_key``."""
    local_sandbox_nodes: int = 1
    """Local cluster only: rollout nodes started next to the head."""
    local_sandbox_slots: int = 4
    """Local cluster only: the sandbox resource each rollout node advertises."""
    local_cpus_per_node: int = 1
    """Local cluster only: Ray CPUs of each node (attempts hold none: they wait on their agent)."""
    local_object_store_mib: int = 100
    """Local cluster only: object store per node (Ray's CLI default is 30 % of RAM per node)."""

    def problems(self) -> list[str]:
        """Config errors (what, why, fix), collected at compose time."""
        out = []
        if self.sandbox_per_attempt <= 0:
            out.append(
                f"scheduler.ray.sandbox_per_attempt must be > 0 (got {self.sandbox_per_attempt}): an attempt "
                "holding none of the resource is not placed on a rollout node. Fix: scheduler.ray.sandbox_per_attempt=1"
            )
        if self.address is None:
            if self.local_sandbox_nodes < 1:
                out.append(
                    f"scheduler.ray.local_sandbox_nodes must be >= 1 (got {self.local_sandbox_nodes}): without a "
                    "rollout node no attempt can be placed. Fix: scheduler.ray.local_sandbox_nodes=1"
                )
            if self.local_sandbox_slots < self.sandbox_per_attempt:
                out.append(
                    f"scheduler.ray.local_sandbox_slots={self.local_sandbox_slots} is below "
                    f"scheduler.ray.sandbox_per_attempt={self.sandbox_per_attempt}: no attempt fits a node. "
                    "Fix: scheduler.ray.local_sandbox_slots=4"
                )
            if self.local_object_store_mib < 80:
                out.append(
                    f"scheduler.ray.local_object_store_mib={self.local_object_store_mib} is below Ray's "
                    "minimum of 78 MiB. Fix: scheduler.ray.local_object_store_mib=100"
                )
        if self.proxy_url is not None and urlsplit(self.proxy_url).scheme not in ("http", "https"):
            out.append(
                f"scheduler.ray.proxy_url={self.proxy_url!r} is not an http(s) URL. "
                "Fix: scheduler.ray.proxy_url=http://HEAD_IP:PORT"
            )
        return out


# --------------------------------------------------------------------------- the remote side


def _remote_attempt(
    harness: str,
    kwargs: dict[str, Any],
    rollout_url: str | None,
    admin_key: str | None,
    run_marker: str | None,
) -> tuple[AttemptResult, JsonObject, dict[str, Any]]:
    """Runs on a rollout node: the attempt as the local runner runs it, plus the proxy's record of
    its session (fetched once the agent's process group is gone) and Ray's placement."""
    import httpx
    import ray

    from fineenvs.harnesses import check_installed, get_harness
    from fineenvs.harnesses.guard import RUN_MARKER_ENV
    from fineenvs.harnesses.installer import install
    from fineenvs.harnesses.sandbox import ProxyStats, proxy_stats_from_rollout, run_attempt

    if run_marker:
        # Agents carry the run's mark, so a restart of the run reaps what a kill left on this node.
        os.environ[RUN_MARKER_ENV] = run_marker
    if check_installed([harness]):
        install(get_harness(harness), echo=log.info)  # the project's pinned installer; no-op when present
    rollout: JsonObject = {}

    def proxy_stats() -> ProxyStats | None:
        if rollout_url is None:
            return None
        headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        resp = httpx.get(rollout_url, headers=headers, timeout=60.0)
        resp.raise_for_status()
        rollout.update(resp.json())
        return proxy_stats_from_rollout(rollout)

    ctx = ray.get_runtime_context()
    placement = {"node_id": ctx.get_node_id(), "hostname": socket.gethostname(), "pid": os.getpid()}
    started = time.monotonic()
    result = run_attempt(get_harness(harness), **kwargs, proxy_stats=proxy_stats)
    placement["seconds"] = round(time.monotonic() - started, 3)
    return result, rollout, placement


def _probe_node(path: str, health_url: str) -> dict[str, Any]:
    """Runs on a rollout node: the probe file the driver wrote (if this node sees it) and whether
    this node reaches the proxy's unauthenticated ``/health`` at the URL its agents will use."""
    import httpx
    import ray

    p = Path(path)
    reached: str | None = None
    for attempt in range(3):  # a busy machine may miss one GET; a closed port fails all three at once
        try:
            httpx.get(health_url, timeout=10.0).raise_for_status()
            reached = None
            break
        except httpx.HTTPError as exc:
            reached = f"{type(exc).__name__}: {str(exc)[:200]}"
            time.sleep(0.5 * (attempt + 1))
    return {
        "seen": p.read_text() if p.is_file() else None,
        "proxy_error": reached,
        "node_id": ray.get_runtime_context().get_node_id(),
        "hostname": socket.gethostname(),
    }


# --------------------------------------------------------------------------- the driver side


class RayAttempts:
    """Dispatches attempts to rollout nodes; the driver's end of the Ray hop."""

    def __init__(
        self, settings: RaySettings, *, proxy_url: str, admin_key: str | None, run_marker: str | None
    ):
        import ray

        self.settings = settings
        self.driver_proxy_url = proxy_url.rstrip("/")
        self.remote_proxy_url = (settings.proxy_url or proxy_url).rstrip("/")
        self.admin_key = admin_key
        self.run_marker = run_marker
        self._task: Any = ray.remote(_remote_attempt).options(
            resources={settings.sandbox_resource: settings.sandbox_per_attempt},
            num_cpus=0,
            # A retried attempt would run the agent twice against one session: Ray must not retry.
            max_retries=0,
        )
        self._inflight: set[Any] = set()

    def remote_base_url(self, base_url: str) -> str:
        """The session's base URL as rollout nodes reach the proxy (the driver's origin replaced)."""
        if base_url.startswith(self.driver_proxy_url):
            return self.remote_proxy_url + base_url[len(self.driver_proxy_url) :]
        return base_url

    async def run(
        self, harness: str, kwargs: dict[str, Any], rollout_path: str
    ) -> tuple[AttemptResult, JsonObject]:
        """The attempt on a rollout node; Ray's faults become ``InfrastructureFailure``."""
        import ray
        from ray import exceptions as rex

        kwargs = {**kwargs, "base_url": self.remote_base_url(kwargs["base_url"])}
        attempt_dir = Path(kwargs["attempt_dir"])
        ref = self._task.remote(
            harness, kwargs, self.remote_proxy_url + rollout_path, self.admin_key, self.run_marker
        )
        self._inflight.add(ref)
        limit = float(kwargs["timeout_seconds"]) + self.settings.placement_timeout_seconds
        try:
            result, rollout, placement = await asyncio.wait_for(asyncio.wrap_future(ref.future()), limit)
        except TimeoutError as exc:
            ray.cancel(ref, force=True)
            raise InfrastructureFailure(
                f"Ray task of attempt {attempt_dir.name} unfinished after {limit:.0f} s (the attempt's timeout "
                f"plus scheduler.ray.placement_timeout_seconds): no live node with the "
                f"'{self.settings.sandbox_resource}' resource took it, or its node hung. Fix: start rollout "
                "nodes with that resource (docs/cluster.md), or raise scheduler.ray.placement_timeout_seconds"
            ) from exc
        except asyncio.CancelledError:
            ray.cancel(ref, force=True)  # the run stops: the attempt's worker (and agent) go too
            raise
        except (rex.NodeDiedError, rex.WorkerCrashedError, rex.ActorDiedError, rex.ObjectLostError,
                rex.OwnerDiedError, rex.TaskUnschedulableError, rex.RaySystemError,
                rex.TaskCancelledError, rex.OutOfMemoryError) as exc:  # fmt: skip
            raise InfrastructureFailure(
                f"attempt {attempt_dir.name} lost to a Ray fault: {type(exc).__name__}: {str(exc)[:300]}"
            ) from exc
        finally:
            self._inflight.discard(ref)
        placement["attempt"] = attempt_dir.name
        with contextlib.suppress(OSError):
            (attempt_dir / PLACEMENT_FILE).write_text(json.dumps(placement) + "\n")
        return result, rollout

    def cancel_all(self) -> None:
        import ray

        for ref in list(self._inflight):
            with contextlib.suppress(Exception):
                ray.cancel(ref, force=True)


def check_rollout_node(out: Path, settings: RaySettings, proxy_url: str) -> dict[str, Any]:
    """Fail at start, with the fix, when a rollout node does not see the driver's output folder
    (the driver grades each attempt's folder, which its node writes) or cannot reach the proxy at
    ``proxy_url`` (its agents' model calls go there). One Ray task on a rollout node checks both."""
    import ray

    probe = out / f".ray-shared-probe-{secrets.token_hex(4)}"
    token = secrets.token_hex(8)
    probe.write_text(token)
    health = proxy_url.rstrip("/") + "/health"
    try:
        task = ray.remote(_probe_node).options(
            resources={settings.sandbox_resource: settings.sandbox_per_attempt}, num_cpus=0, max_retries=0
        )
        try:
            seen: dict[str, Any] = ray.get(
                task.remote(str(probe), health), timeout=settings.placement_timeout_seconds
            )
        except ray.exceptions.GetTimeoutError as exc:
            raise InfrastructureFailure(
                f"no Ray node with the '{settings.sandbox_resource}' resource took a task within "
                f"{settings.placement_timeout_seconds:.0f} s. Start rollout nodes with "
                f"`ray start --address=HEAD:PORT --resources='{{\"{settings.sandbox_resource}\": 4}}'` "
                "(docs/cluster.md), or fix scheduler.ray.sandbox_resource."
            ) from exc
    finally:
        probe.unlink(missing_ok=True)
    problems = []
    node = f"rollout node {seen['hostname']} (Ray node {str(seen['node_id'])[:12]})"
    if seen["seen"] != token:
        problems.append(
            f"{node} cannot read {out} (the run's output folder): the driver grades each attempt's "
            "folder, which the attempt's node writes, so paths.output_dir must be on a filesystem every node "
            "mounts at the same path (NFS, Lustre, ...). Fix: hydra.run.dir=/shared/path/... (docs/cluster.md)."
        )
    if seen["proxy_error"] is not None:
        host = urlsplit(proxy_url).hostname or ""
        why = (
            f"scheduler.ray.proxy_url={settings.proxy_url}"
            if settings.proxy_url
            else f"scheduler.ray.proxy_url is null, so nodes use the driver's own proxy address {proxy_url}"
        )
        if host in ("127.0.0.1", "localhost", "::1") or host.startswith("127."):
            why += ", a loopback address only the driver's machine reaches"
        problems.append(
            f"{node} cannot reach the proxy at {health} ({seen['proxy_error']}): every agent on that node "
            f"sends its model calls there. {why}. Fix: scheduler.ray.proxy_url=http://DRIVER_IP:PORT with "
            "proxy.host=0.0.0.0 proxy.port=PORT proxy.admin_key=... (or +cluster=ray), and a network path "
            "from the rollout nodes to that port (docs/cluster.md)."
        )
    if problems:
        raise InfrastructureFailure(" ".join(problems))
    return seen


class LocalCluster:
    """A head and ``local_sandbox_nodes`` rollout nodes on this machine, started through Ray's
    ``cluster_utils.Cluster`` in a temporary folder of their own, and only those stopped."""

    def __init__(self, settings: RaySettings, out: Path) -> None:
        self.settings = settings
        self.out = out
        self.tmp = Path(tempfile.mkdtemp(prefix="fineenvs-ray-"))
        self._env: dict[str, str | None] = {}
        self._enable_cluster: bool | None = None
        self.cluster: Any = None

    def start(self) -> str:
        from ray.cluster_utils import Cluster

        s = self.settings
        _remove_stale_temp_dir(self.out)
        # RAY_TMPDIR: Ray writes its session folders and the "current cluster" address file there,
        # not in the machine-wide /tmp/ray another user's cluster may own. LOOPBACK_ENV: without it
        # Ray turns 127.0.0.1 into the machine's interface address and binds every node there, and
        # a cluster started this way runs without token authentication: anyone on the network
        # could submit work to it.
        for key, value in (*NODE_ENV.items(), *LOOPBACK_ENV.items(), ("RAY_TMPDIR", str(self.tmp))):
            self._env[key] = os.environ.get(key)
            os.environ[key] = value
        # Ray read that switch when this process imported it; its workers read it from the env.
        from ray._private import ray_constants

        self._enable_cluster = ray_constants.ENABLE_RAY_CLUSTER
        ray_constants.ENABLE_RAY_CLUSTER = False
        common = {
            "num_cpus": s.local_cpus_per_node,
            "object_store_memory": s.local_object_store_mib * 2**20,
            "node_ip_address": LOOPBACK,
        }
        started = time.monotonic()
        self.cluster = Cluster(initialize_head=True, head_node_args={**common, "include_dashboard": False})
        nodes = [
            self.cluster.add_node(**common, resources={s.sandbox_resource: float(s.local_sandbox_slots)})
            for _ in range(s.local_sandbox_nodes)
        ]
        info = {
            "address": self.cluster.address,
            "temp_dir": str(self.tmp),
            "head": _node_info(self.cluster.head_node),
            "sandbox_nodes": [_node_info(n) for n in nodes],
            "start_seconds": round(time.monotonic() - started, 2),
        }
        (self.out / CLUSTER_FILE).write_text(json.dumps(info, indent=1) + "\n")
        return str(self.cluster.address)

    def reap(self) -> None:
        """Collect the exit status of any of its Ray processes that died: they are this process's
        children, and a dead raylet left a zombie keeps its workers (and their attempts) running
        as if the node were alive (Ray's own ``Node`` reaps only when it kills)."""
        if self.cluster is None:
            return
        for node in [self.cluster.head_node, *self.cluster.worker_nodes]:
            for infos in list(node.all_processes.values()):
                for info in infos:
                    info.process.poll()

    def stop(self) -> None:
        if self.cluster is not None:
            with contextlib.suppress(Exception):
                self.cluster.shutdown()
            self.cluster = None
        if self._enable_cluster is not None:
            from ray._private import ray_constants

            ray_constants.ENABLE_RAY_CLUSTER = self._enable_cluster
        for key, value in self._env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(self.tmp, ignore_errors=True)


def _remove_stale_temp_dir(out: Path) -> None:
    """A SIGKILLed run's Ray processes die with it (Ray's reaper), but its session folder stays:
    the next run on the same output folder removes it, once nothing of the cluster runs there."""
    try:
        old = Path(json.loads((out / CLUSTER_FILE).read_text())["temp_dir"])
    except (OSError, ValueError, KeyError):
        return
    if old.name.startswith("fineenvs-ray-") and old.is_dir() and not _processes_under(old):
        shutil.rmtree(old, ignore_errors=True)


def _processes_under(folder: Path) -> list[int]:
    """Live processes whose command line names ``folder`` (every Ray process of a local cluster)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if str(folder).encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


def _node_info(node: Any) -> dict[str, Any]:
    raylet = node.all_processes.get("raylet") or []
    return {
        "node_id": node.node_id,
        "ip": node.node_ip_address,
        "raylet_pid": raylet[0].process.pid if raylet else None,
    }


def _reap_every(local: LocalCluster, done: threading.Event) -> None:
    while not done.wait(0.5):
        local.reap()


@contextlib.asynccontextmanager
async def ray_attempts(
    settings: RaySettings, *, proxy_url: str, admin_key: str | None, out: Path
) -> AsyncIterator[RayAttempts]:
    """Connect to (or start) the cluster, check rollout nodes see ``out``, yield the dispatcher;
    on leaving, cancel attempts still running and disconnect (and stop a local cluster)."""
    import ray

    from fineenvs.harnesses.guard import RUN_MARKER_ENV

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    local = None if settings.address else LocalCluster(settings, out)
    try:
        address = local.start() if local else settings.address
        ray.init(
            address=address,
            log_to_driver=False,
            configure_logging=False,
            # A local cluster's nodes are on loopback. An existing cluster: Ray's own choice, the
            # address its `ray start` registered this machine's node under. Ray 2.60 turns a loopback
            # address (`ray start --node-ip-address=127.0.0.1`, `address=127.0.0.1:P`) into the
            # machine's interface address on both sides, so the pair still matches (tested:
            # tests/integration/test_ray_existing_cluster.py).
            _node_ip_address=LOOPBACK if local else None,
        )
        # Ray's Cluster nodes and ray.init install SIGTERM handlers of their own in this process
        # (exit at once); SIGTERM must keep stopping the run as Ctrl-C does (fineenvs.lifecycle),
        # which unwinds this context and stops the cluster here.
        for sig, handler in handlers.items():
            if handler is not None:
                signal.signal(sig, handler)
        where = f"local cluster ({settings.local_sandbox_nodes} rollout nodes)" if local else address
        print(f"Built Ray backend on {where} at {ray.get_runtime_context().gcs_address}", flush=True)
        attempts = RayAttempts(
            settings, proxy_url=proxy_url, admin_key=admin_key, run_marker=os.environ.get(RUN_MARKER_ENV)
        )
        await asyncio.to_thread(check_rollout_node, out, settings, attempts.remote_proxy_url)
        done = threading.Event()
        if local is not None:
            threading.Thread(target=_reap_every, args=(local, done), name="ray-reaper", daemon=True).start()
        try:
            yield attempts
        finally:
            done.set()
            attempts.cancel_all()
    finally:
        ray.shutdown()
        if local is not None:
            local.stop()
