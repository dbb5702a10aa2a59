"""``--workers N``: N proxy processes, each owning a disjoint shard of the sessions.

Why: one Python process spends about a millisecond of CPU per model call (parse, convert, record,
fsync, reply), so a single proxy tops out near a thousand calls per second whatever the machine.
With spare cores, sharding sessions over processes multiplies that; nothing is shared between
them but the store directory, where each session's log has exactly one writer.

How it fits together:

- The main process binds the public port, runs shard 0 (model calls of its own sessions) and the
  whole control plane. It binds one more listening socket per extra worker (on the same host, at
  ``port + k`` when the port is fixed and free, so a restart keeps the ``base_url`` agents hold;
  a free port otherwise) and starts
  ``python -m fineenvs.proxy.worker`` with the socket inherited and the settings in the
  environment; a worker that exits is started again on the same socket (records are durable, so a
  worker crash loses no acknowledged call).
- A session belongs to shard ``shard_of(session_id, N)``: a stable hash, so routing needs no table
  and a user-chosen ``session_id`` is checked for uniqueness by the one shard that can own it.
  ``POST /sessions`` answers with the owning worker's ``base_url``; agents talk to that port
  directly, so model calls never cross processes. Stats, rollouts, closing and listing are
  forwarded to the owner by the main process.
- Workers' control routes require an internal admin key (random per start, never printed);
  the user's admin key, when set, guards the main process as before.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import orjson

from fineenvs.jsonl import JsonObject
from fineenvs.proxy.settings import ProxySettings, SamplingPolicy

log = logging.getLogger("fineenvs.proxy.workers")
SPEC_ENV = "FINEENVS_PROXY_WORKER"
MAX_WORKERS = 64


def share_of_engine(settings: ProxySettings) -> int:
    """Engine connections per process: together within the configured bound (at least one each)."""
    return max(1, settings.max_upstream_concurrency // settings.workers)


def settings_to_json(settings: ProxySettings) -> JsonObject:
    return dataclasses.asdict(settings)


def settings_from_json(data: JsonObject) -> ProxySettings:
    data = dict(data)
    data["sampling"] = SamplingPolicy(**data["sampling"])
    return ProxySettings(**data)


@dataclass
class Worker:
    shard: int
    sock: socket.socket
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = 0.0
    quick_exits: int = 0  # exits in a row within 10 s of starting: restarts back off
    retry_at: float = 0.0

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class WorkerPool:
    """The main process's side: sockets, child processes, restarts, and control forwarding."""

    def __init__(self, settings: ProxySettings, *, log_level: str = "warning") -> None:
        if not 2 <= settings.workers <= MAX_WORKERS:
            raise ValueError(f"a worker pool needs 2..{MAX_WORKERS} workers, got {settings.workers}.")
        self.settings = settings
        self.shards = settings.workers
        self.log_level = log_level
        self.internal_key = secrets.token_urlsafe(32)
        self.workers: list[Worker] = []
        self._client: httpx.AsyncClient | None = None
        self._monitor: asyncio.Task[None] | None = None
        self._stopping = False

    # -- processes -----------------------------------------------------------------------------

    def bind(self) -> None:
        """Bind one listening socket per extra shard (before the main server starts)."""
        host = self.settings.host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        for shard in range(1, self.shards):
            port = self.settings.port + shard if self.settings.port else 0
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                try:
                    sock.bind((host, port))
                except OSError as exc:
                    if not port:
                        raise
                    # Something else holds P+k: any free port works for this run (base_url names
                    # it); only a restart would hand that shard's agents a different port.
                    log.warning(
                        "proxy worker %d: %s:%d is busy (%s); using a free port instead",
                        shard,
                        host,
                        port,
                        exc,
                    )
                    sock.bind((host, 0))
            except OSError as exc:
                sock.close()
                self.close_sockets()
                raise OSError(
                    f"fineenvs proxy: worker {shard} cannot bind a port on {host} ({exc})."
                ) from exc
            sock.listen(4096)
            sock.set_inheritable(True)
            self.workers.append(Worker(shard, sock))

    def _spawn(self, worker: Worker) -> None:
        settings = dataclasses.replace(
            self.settings,
            admin_key=self.internal_key,
            port=worker.port,
            max_upstream_concurrency=share_of_engine(self.settings),
        )
        spec = {
            "settings": settings_to_json(settings),
            "fd": worker.sock.fileno(),
            "shard": worker.shard,
            "shards": self.shards,
            "parent": os.getpid(),
            "log_level": self.log_level,
        }
        env = {**os.environ, SPEC_ENV: orjson.dumps(spec).decode()}
        env.pop("FINEENVS_ADMIN_KEY", None)
        # A session of its own: Ctrl-C in the terminal reaches only the main process, which stops
        # the workers itself (a worker killed by the terminal would be restarted mid-shutdown).
        worker.proc = subprocess.Popen(
            [sys.executable, "-m", "fineenvs.proxy.worker"],
            env=env,
            pass_fds=(worker.sock.fileno(),),
            start_new_session=True,
        )
        worker.started_at = time.time()

    def start(self) -> None:
        if not self.workers:
            self.bind()
        for worker in self.workers:
            self._spawn(worker)

    async def run_monitor(self) -> None:
        """Start again any worker that exited (its socket stays bound, so agents just retry)."""
        while not self._stopping:
            now = time.time()
            for worker in self.workers:
                if worker.proc is None or worker.proc.poll() is None or self._stopping:
                    continue
                if worker.retry_at == 0.0:
                    quick = now - worker.started_at < 10
                    worker.quick_exits = worker.quick_exits + 1 if quick else 0
                    delay = min(30.0, 0.5 * 2**worker.quick_exits) if quick else 0.0
                    worker.retry_at = now + delay
                    log.error(
                        "proxy worker %d exited with %s; starting it again in %.1f s",
                        worker.shard,
                        worker.proc.returncode,
                        delay,
                    )
                if now >= worker.retry_at:
                    worker.restarts += 1
                    worker.retry_at = 0.0
                    self._spawn(worker)
            await asyncio.sleep(0.5)

    async def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        for worker in self.workers:
            while True:
                try:
                    resp = await self.client.get(f"{self._url(worker)}/health", timeout=2)
                    if resp.status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if not worker.alive:
                    raise RuntimeError(
                        f"fineenvs proxy: worker {worker.shard} exited at start (see its log)."
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"fineenvs proxy: worker {worker.shard} did not answer within {timeout} s."
                    )
                await asyncio.sleep(0.1)

    async def startup(self) -> None:
        try:
            self.start()
            await self.wait_ready()
        except BaseException:
            await self.shutdown()
            raise
        self._monitor = asyncio.create_task(self.run_monitor())

    async def shutdown(self) -> None:
        self._stopping = True
        if self._monitor is not None:
            self._monitor.cancel()
        for worker in self.workers:
            if worker.alive and worker.proc is not None:
                worker.proc.send_signal(signal.SIGTERM)
        for worker in self.workers:
            if worker.proc is None:
                continue
            try:
                await asyncio.to_thread(worker.proc.wait, 30)
            except subprocess.TimeoutExpired:
                worker.proc.kill()
        if self._client is not None:
            await self._client.aclose()
        self.close_sockets()

    def close_sockets(self) -> None:
        for worker in self.workers:
            worker.sock.close()

    # -- control forwarding --------------------------------------------------------------------

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=600, trust_env=False)
        return self._client

    def _url(self, worker: Worker) -> str:
        host = self.settings.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        return f"http://[{host}]:{worker.port}" if ":" in host else f"http://{host}:{worker.port}"

    def worker(self, shard: int) -> Worker:
        return self.workers[shard - 1]

    async def forward(
        self, shard: int, method: str, path: str, *, query: bytes = b"", body: bytes | None = None
    ) -> httpx.Response:
        worker = self.worker(shard)
        url = f"{self._url(worker)}{path}" + (f"?{query.decode('latin-1')}" if query else "")
        headers = {"authorization": f"Bearer {self.internal_key}", "content-type": "application/json"}
        for attempt in range(20):
            try:
                return await self.client.request(method, url, content=body, headers=headers)
            except httpx.ConnectError:
                # Nothing reached the worker, so a retry cannot apply anything twice (a request that
                # may have arrived, e.g. a create whose reply was lost, is not retried).
                if attempt == 19:
                    raise
                await asyncio.sleep(0.25)
        raise AssertionError("unreachable")

    def status(self) -> list[JsonObject]:
        return [
            {"shard": w.shard, "port": w.port, "alive": w.alive, "restarts": w.restarts} for w in self.workers
        ]
