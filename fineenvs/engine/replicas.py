"""Several vLLM servers behind vLLM's own router, driven as one engine.

Generation goes through the router, which pins each agent session to one replica (the proxy sends
the session id in ``x-session-id``; the ``consistent_hash`` policy hashes it), so a session's
growing history keeps hitting one prefix cache. Control goes to every serving replica directly,
concurrently: a push pauses them all, installs the staged weights on each, and only then resumes
them, so a version is served only once every serving replica holds it.

What a replica that fails gets (``docs/scaling-out.md``): a launched replica that fails its push or
dies (SIGKILL, OOM) is taken out of routing at once (``/remove_worker``), stopped, started again on
its port from the base model, given the current weights and version, and only then routed to
again (``/add_worker``). A replica someone else runs (``engine.urls``) cannot be restarted: a failed
push stops the run, which resumes from its last checkpoint.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import httpx

from fineenvs.engine.weights import PAUSE_MODE, StagedVLLMWeightSync, Weights, WeightSyncError

if TYPE_CHECKING:
    from subprocess import Popen
    from types import TracebackType

    from fineenvs.engine.router import RouterHandle


class ServerLaunch(Protocol):
    """A launched server as the replica set drives it (``fineenvs.engine.handle.EngineLaunch``)."""

    @property
    def process(self) -> Popen[bytes] | None: ...

    def __enter__(self) -> object: ...

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


@dataclass
class Replica:
    """One vLLM server of the set: its direct URL (as registered with the router) and its weight
    sync; ``relaunch`` starts it again (None: someone else runs it)."""

    name: str
    url: str
    sync: StagedVLLMWeightSync
    launch: ServerLaunch | None = None
    relaunch: Callable[[], tuple[ServerLaunch, StagedVLLMWeightSync]] | None = None
    serving: bool = True
    restarts: int = 0
    failures: list[str] = field(default_factory=list)


class ReplicaSet:
    """N replicas and their router as one weight sync (``push``, ``announce``, ``close``), plus a
    watcher that restarts a launched replica that dies."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        router: RouterHandle,
        *,
        health_interval_s: float = 1.0,
        log: Callable[[str], None] = print,
    ) -> None:
        if not replicas:
            raise ValueError("a replica set needs at least one replica")
        self.replicas = list(replicas)
        self.router = router
        self.health_interval_s = health_interval_s
        self.log = log
        self.version: int | None = None
        self.staged: Path | None = None
        """The current weights as staged for the last push (None: the base model's)."""
        self._stager = self.replicas[0].sync
        """Stages every push and prunes older copies: one object, whichever replicas serve (the
        staging folder is shared, and staging touches no server)."""
        self._lock = threading.RLock()  # one push or one return to routing at a time
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(max_workers=max(2, len(self.replicas)), thread_name_prefix="replica")

    # -- what serves --------------------------------------------------------------------------

    def serving(self) -> list[Replica]:
        with self._lock:
            return [r for r in self.replicas if r.serving]

    def serving_urls(self) -> list[str]:
        return [r.url for r in self.serving()]

    # -- the weight sync ----------------------------------------------------------------------

    def push(self, weights: Weights, version: int) -> int:
        """Stage once, then on every serving replica at the same time: pause; install; resume
        only when every one has installed (a failed one is taken out of routing first)."""
        with self._lock:
            live = [r for r in self.replicas if r.serving]
            if not live:
                raise WeightSyncError(
                    f"no replica is serving (all {len(self.replicas)} are out of routing): nothing to push to. "
                    "The run stops; rerunning it resumes from its last checkpoint with fresh replicas."
                )
            staged = self._stager.stage(weights, version)
            failed = self._each(live, lambda r: r.sync.ready(staged))
            ok = [r for r in live if r.name not in failed]
            paused = self._each(
                ok, lambda r: r.sync.server.post("/pause", "pause", params={"mode": PAUSE_MODE})
            )
            failed.update(paused)
            ok = [r for r in ok if r.name not in paused]
            failed.update(self._each(ok, lambda r: r.sync.install(staged, version)))
            for r in live:
                if r.name in failed:
                    self._take_out(r, f"its push of version {version} failed: {failed[r.name]}")
            # Every replica still routed to holds the new weights: resuming them now serves one version.
            resumed = [r for r in live if r.name not in failed]
            failed.update(
                self._each(resumed, lambda r: r.sync.server.post("/resume", "resume")),
            )
            failed.update(self._each(resumed, lambda r: r.sync.server.check_version(version)))
            self.version, self.staged = version, staged
            self._stager.prune()
            self._settle(live, failed, f"version {version}")
            return version

    def announce(self, version: int) -> None:
        with self._lock:
            live = [r for r in self.replicas if r.serving]
            failed = self._each(live, lambda r: r.sync.announce(version))
            self.version = version
            self._settle(live, failed, f"the label of version {version}")

    def _settle(self, live: list[Replica], failed: dict[str, str], what: str) -> None:
        """After a control call on ``live``: the failed ones are out of routing; those that can
        restart come back with ``what``; an attached one, or none left serving, stops the run."""
        if not failed:
            return
        for r in live:
            if r.name in failed and r.serving:
                self._take_out(r, f"it failed {what}: {failed[r.name]}")
        attached = [r.name for r in live if r.name in failed and r.relaunch is None]
        # Out of routing, but not left paused: someone else runs it and may use it after the run.
        self._each([r for r in live if r.name in attached], lambda r: r.sync.server.post("/resume", "resume"))
        if attached or not any(r.serving for r in self.replicas):
            details = "; ".join(f"{name}: {why}" for name, why in failed.items())
            raise WeightSyncError(
                f"replicas failed {what} ({details}). "
                + (
                    f"{', '.join(attached)} run outside fineenvs (engine.urls) and cannot be restarted with "
                    "the current weights, so the run stops; "
                    if attached
                    else "No replica is left serving, so the run stops; "
                )
                + "rerunning the same command resumes from its last checkpoint."
            )

    def _each(self, replicas: Sequence[Replica], call: Callable[[Replica], object]) -> dict[str, str]:
        """``call`` on every replica concurrently; the failures by replica name."""

        def attempt(r: Replica) -> tuple[str, str | None]:
            try:
                call(r)
            except (WeightSyncError, httpx.HTTPError, OSError) as exc:
                return r.name, str(exc)
            return r.name, None

        results = list(self._pool.map(attempt, replicas))
        return {name: why for name, why in results if why is not None}

    # -- out of routing and back ----------------------------------------------------------------

    def _take_out(self, replica: Replica, why: str) -> None:
        """Stop routing to ``replica`` now (the router's own health check would take seconds)."""
        if not replica.serving:
            return
        replica.serving = False
        replica.failures.append(why)
        self.log(f"replica {replica.name} ({replica.url}) out of routing: {why}")
        try:
            self.router.remove_worker(replica.url)
        except httpx.HTTPError as exc:
            self.log(f"replica {replica.name}: the router did not take it out ({exc}); its health check will")

    def _restart(self, replica: Replica) -> None:
        """Start ``replica`` again and route to it once it holds the current weights. Runs on the
        watcher thread: the new server is tied to the thread that starts it (``launcher``)."""
        assert replica.relaunch is not None
        if replica.launch is not None:
            replica.launch.__exit__(None, None, None)  # the whole process group, leftovers included
            replica.launch = None
        self.log(f"replica {replica.name}: restarting on {replica.url}")
        launch, sync = replica.relaunch()
        launch.__enter__()
        if replica.sync is not self._stager:
            replica.sync.close()
        replica.launch, replica.sync = launch, sync
        with self._lock:
            if self.staged is not None and self.version is not None:
                sync.ready(self.staged)
                sync.install(self.staged, self.version)
                sync.server.check_version(self.version)
            elif self.version is not None:
                sync.announce(self.version)
            self.router.add_worker(replica.url)
            replica.serving = True
            replica.restarts += 1
        self.log(f"replica {replica.name}: serving again at version {self.version}")

    # -- the watcher ----------------------------------------------------------------------------

    def watch(self) -> None:
        """Start the watcher: a launched replica whose process died or that stops answering
        ``/health`` twice is taken out of routing and restarted."""
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="replica-watcher", daemon=True)
            self._watcher.start()

    def _watch(self) -> None:
        misses: dict[str, int] = {}
        with httpx.Client(timeout=max(2.0, self.health_interval_s)) as client:
            while not self._stop.wait(self.health_interval_s):
                for r in self.replicas:
                    if r.relaunch is None or self._stop.is_set():
                        continue
                    if r.serving:
                        state = _health(client, r)
                        misses[r.name] = 0 if state == "ok" else misses.get(r.name, 0) + 1
                        if state == "ok" or (state == "miss" and misses[r.name] < 2):
                            continue
                        why = "its process died" if state == "dead" else "it stopped answering /health"
                        with self._lock:
                            self._take_out(r, why)
                    try:
                        self._restart(r)
                        misses[r.name] = 0
                    except Exception as exc:  # noqa: BLE001 - the watcher reports and tries again later
                        self.log(f"replica {r.name}: restart failed ({exc}); trying again")
                        time.sleep(self.health_interval_s)

    def close(self) -> None:
        """Stop the watcher, close every weight sync, and stop the replicas launched here (side by
        side: each may take its grace period)."""
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=30.0)
        for sync in {id(s): s for s in [self._stager, *(r.sync for r in self.replicas)]}.values():
            sync.close()
        launched = [r.launch for r in self.replicas if r.launch is not None]
        list(self._pool.map(lambda launch: launch.__exit__(None, None, None), launched))
        for r in self.replicas:
            r.launch = None
        self._pool.shutdown(wait=False)


def _health(client: httpx.Client, replica: Replica) -> str:
    """``dead`` (its process exited: no need to ask twice), ``miss`` (no 200 from /health), ``ok``."""
    process = replica.launch.process if replica.launch is not None else None
    if process is not None and process.poll() is not None:
        return "dead"
    try:
        return "ok" if client.get(replica.url + "/health").status_code == 200 else "miss"
    except httpx.HTTPError:
        return "miss"
