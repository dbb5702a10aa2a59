"""Many inference replicas behind vLLM's own router (``vllm-router``), not a router of our own.

The router is a Rust binary from PyPI (``vllm-router``, no torch), installed into a venv of its
own in the cache: ``python -m fineenvs.engine install-router``. ``launch_router`` runs it as a
child process for the duration of a ``with`` block; ``attach_router`` talks to one run elsewhere
(``engine.router.url``). Its ``consistent_hash`` policy keeps every call of a session on one
replica as long as the set of available replicas does not change, keyed on ``SESSION_HEADER``.
Each replica names itself in ``REPLICA_HEADER`` on its responses (``serve --replica-name`` on the
embedded engine, ``ReplicaHeaderMiddleware`` of the vLLM plugin), which the router passes through.

Top-level imports are the standard library only: ``fineenvs.config`` imports ``RouterOptions``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

if TYPE_CHECKING:
    from fineenvs.engine.launcher import Launched

ROUTER_PACKAGE = "vllm-router"
ROUTER_VERSION = "0.1.17"
SESSION_HEADER = "x-session-id"
"""The header ``consistent_hash`` hashes; without it every call goes to one worker (0.1.17 does
not look at the body)."""
REPLICA_HEADER = "x-fineenvs-replica"
"""The header each replica stamps on its responses; the router passes upstream headers through."""
HEALTH_PATH = "/readiness"
"""200 while at least one replica is healthy (503 otherwise). The router listens only once a
replica answers; ``/liveness`` is 200 from then on whatever the replicas do, ``/health`` is 503 as
soon as one replica is unhealthy."""
STAMP = ".fineenvs-build.json"
INSTALL_COMMAND = "python -m fineenvs.engine install-router"


@dataclass
class RouterOptions:
    """``engine.router``: vLLM's router in front of several replicas."""

    url: str | None = None
    """A router someone else runs (``http://host:port``); None: fineenvs starts one."""
    policy: str = "consistent_hash"
    """Keeps a session's calls on one replica (its prefix cache stays warm); the router's default,
    cache_aware, looks at the body, which 0.1.17 does not see on chat calls."""
    host: str = "127.0.0.1"
    """The router forwards to replicas whose weight routes load local files: not for other hosts."""
    port: int = 0
    """0: a free port, so that runs on one machine do not collide."""
    health_check_interval_s: int = 2
    """The router's 60 s would send a dead replica's sessions to it for minutes."""
    health_failure_threshold: int = 2
    """Two missed checks (about 4 s): one slow /health under load is not a death."""
    executable: str | None = None
    """A ``vllm-router`` binary to run; None: the pinned build in the cache (``install-router``)."""


class RouterError(RuntimeError):
    """The router is missing, refused a change, or did not start; the message says the fix."""


# --- install ----------------------------------------------------------------------------------


def router_dir() -> Path:
    from fineenvs.paths import cache_dir

    return cache_dir() / "router" / f"{ROUTER_PACKAGE}-{ROUTER_VERSION}"


def _installed() -> Path | None:
    directory = router_dir()
    binary = directory / "bin" / "vllm-router"
    try:
        stamp = json.loads((directory / STAMP).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(stamp, dict) or stamp.get("version") != ROUTER_VERSION or not binary.exists():
        return None
    return binary


def router_executable(options: RouterOptions) -> Path | None:
    """The binary ``options`` runs (None: not installed, or ``executable`` not found)."""
    if options.executable is not None:
        found = shutil.which(options.executable)
        return Path(found) if found else None
    return _installed()


def router_problem(options: RouterOptions) -> str | None:
    """Why the router of ``options`` cannot run here, with the fix (None: it can)."""
    if options.url is not None or router_executable(options) is not None:
        return None
    if options.executable is not None:
        return (
            f"engine.router.executable={options.executable!r} is not an executable file or on PATH. "
            f"Fix: point it at a vllm-router binary, or leave it unset and run `{INSTALL_COMMAND}`."
        )
    return (
        f"vLLM's router ({ROUTER_PACKAGE} {ROUTER_VERSION}) is not installed in {router_dir()}. "
        f"Fix: run `{INSTALL_COMMAND}`, or set engine.router.url to a router that is running."
    )


REINSTALL = f"`{INSTALL_COMMAND} --force`"
NEEDS_INDEX = f"the machine needs PyPI, or a pip index with this wheel (PIP_INDEX_URL); then {REINSTALL}"


def _run(cmd: list[str], what: str, fix: str = REINSTALL) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RouterError(
            f"install-router: {what} failed ({' '.join(cmd)}):\n{(done.stderr or done.stdout)[-3000:]}\n"
            f"Fix: {fix}."
        )
    return done.stdout


def install_router(force: bool = False, log: bool = True) -> Path:
    """Build (or reuse) the router's venv in the cache; returns the ``vllm-router`` binary."""
    binary = None if force else _installed()
    if binary is not None:
        return binary
    directory = router_dir()
    if directory.exists():
        shutil.rmtree(directory)  # an incomplete build (no stamp): start over
    directory.parent.mkdir(parents=True, exist_ok=True)
    if log:
        print(f"install-router: {ROUTER_PACKAGE}=={ROUTER_VERSION} in {directory}", file=sys.stderr)
    _run([sys.executable, "-m", "venv", str(directory)], "creating the venv")
    python = directory / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    _run([*pip, f"{ROUTER_PACKAGE}=={ROUTER_VERSION}"], f"installing {ROUTER_PACKAGE}", NEEDS_INDEX)
    binary = directory / "bin" / "vllm-router"
    # The command is a Python entry point around the Rust core; it has no --version.
    _run([str(binary), "--help"], "running `vllm-router --help`")
    # The wheel needs no torch (fastapi, aiohttp and the Rust core): torch here would mean the
    # index served something else under the pin, gigabytes the router never uses.
    listed = _run([str(python), "-m", "pip", "list", "--format=json"], "listing the venv")
    if any(p["name"].lower() == "torch" for p in json.loads(listed)):
        raise RouterError(
            f"install-router: {ROUTER_PACKAGE}=={ROUTER_VERSION} pulled torch into {directory}, which "
            "the pinned wheel does not need. Fix: check the index serves the PyPI wheel, then "
            f"`{INSTALL_COMMAND} --force`."
        )
    stamp = {"package": ROUTER_PACKAGE, "version": ROUTER_VERSION}
    (directory / STAMP).write_text(json.dumps(stamp) + "\n")  # last: the build is complete
    return binary


# --- command ----------------------------------------------------------------------------------


def router_command(
    options: RouterOptions,
    worker_urls: list[str],
    *,
    port: int,
    prometheus_port: int,
    log_dir: Path | None = None,
    executable: Path | str | None = None,
) -> list[str]:
    """The ``vllm-router`` argv for ``options`` in front of ``worker_urls``. ``log_dir``: the
    router also writes its own day-stamped log files there (its stdout is the launcher's log).
    ``--worker-startup-timeout-secs`` keeps its 600 s: a vLLM replica added while it loads needs
    minutes."""
    binary = executable or router_executable(options)
    if binary is None:
        raise RouterError(router_problem(options) or "vllm-router is not installed")
    if not worker_urls:
        raise RouterError("the router needs at least one replica URL (worker_urls is empty)")
    cmd = [str(binary), "--host", options.host, "--port", str(port)]
    # The ring is built from the URLs exactly as given: a trailing slash is another worker.
    cmd += ["--worker-urls", *(u.rstrip("/") for u in worker_urls)]
    cmd += ["--policy", options.policy]
    # A retry selects the worker again: it can move a session mid-call and run a generation
    # twice. A failed call must fail where the caller sees it.
    cmd += ["--disable-retries"]
    # The default 60 s interval keeps sending a dead replica's sessions to it for minutes.
    cmd += ["--health-check-interval-secs", str(options.health_check_interval_s)]
    cmd += ["--health-failure-threshold", str(options.health_failure_threshold)]
    # Metrics are always on, at 29000 unless told: a second router on the machine would fail to bind.
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port)]
    # Start-up and /add_worker poll a replica's /health every 30 s by default: a replica that is
    # a moment late would cost half a minute.
    cmd += ["--worker-startup-check-interval", "1"]
    # The timeout covers a whole streamed body; long agent generations must not be cut by the
    # router (the proxy has its own limits), so the router's is only a backstop.
    cmd += ["--request-timeout-secs", "7200"]
    if log_dir is not None:
        cmd += ["--log-dir", str(log_dir)]
    return cmd


# --- handle -----------------------------------------------------------------------------------


class RouterHandle:
    """A running router: its URL and its replica set, which can be changed while it runs."""

    def __init__(self, url: str, worker_urls: list[str], pid: int | None = None) -> None:
        self.url = url.rstrip("/")
        self.worker_urls = [u.rstrip("/") for u in worker_urls]
        """The replicas as registered (the ring hashes these exact strings)."""
        self.pid = pid

    def __repr__(self) -> str:
        return f"RouterHandle(url={self.url!r}, worker_urls={self.worker_urls!r}, pid={self.pid})"

    def _post(self, route: str, worker_url: str, timeout_s: float) -> str:
        import httpx

        url = worker_url.rstrip("/")
        try:
            response = httpx.post(f"{self.url}{route}?url={quote(url, safe='')}", timeout=timeout_s)
        except httpx.HTTPError as exc:
            raise RouterError(
                f"{route} {url} on the router {self.url} failed: {exc!r}. Fix: check the router is "
                f"running (GET {self.url}{HEALTH_PATH}) and that the replica answers {url}/health."
            ) from exc
        if response.status_code != 200:
            raise RouterError(
                f"the router {self.url} refused {route} {url}: {response.status_code} {response.text[:300]}"
            )
        return url

    def add_worker(self, url: str, timeout_s: float = 660.0) -> None:
        """Register a replica; blocks until its /health answers 200 (the router waits for that)."""
        added = self._post("/add_worker", url, timeout_s)
        if added not in self.worker_urls:
            self.worker_urls.append(added)

    def remove_worker(self, url: str, timeout_s: float = 30.0) -> None:
        """Unregister a replica: its sessions move to their next replica on the ring, no other does.
        The router answers 200 even for a URL it does not know, so that is checked here."""
        removed = url.rstrip("/")
        known = [w["url"] for w in self.workers()]
        if removed not in known:
            raise RouterError(
                f"{removed} is not a replica of the router {self.url} (it has {known}); "
                "pass the URL exactly as it was registered"
            )
        self._post("/remove_worker", removed, timeout_s)
        if removed in self.worker_urls:
            self.worker_urls.remove(removed)

    def workers(self, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        """``GET /workers``: per replica its ``url``, ``is_healthy``, ``load`` and more."""
        import httpx

        response = httpx.get(self.url + "/workers", timeout=timeout_s)
        response.raise_for_status()
        workers = response.json().get("workers", [])
        return [dict(w) for w in workers]


def attach_router(url: str, timeout_s: float = 10.0) -> RouterHandle:
    """A handle on a router run elsewhere (``engine.router.url``); fails if it does not answer."""
    import httpx

    base = url.rstrip("/")
    try:
        response = httpx.get(base + "/list_workers", timeout=timeout_s)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        raise RouterError(
            f"engine.router.url={url!r} does not answer GET /list_workers as vllm-router does: {exc!r}. "
            "Fix: start the router first, or leave engine.router.url unset to have fineenvs start one."
        ) from exc
    return RouterHandle(base, list(response.json().get("urls", [])))


# --- launch -----------------------------------------------------------------------------------


class RouterLaunch(AbstractContextManager[RouterHandle], AbstractAsyncContextManager[RouterHandle]):
    """The router running for a ``with`` or ``async with`` block, answering on entry, stopped on
    any exit (``Launched``: its own process group, SIGTERM then SIGKILL)."""

    def __init__(
        self, options: RouterOptions, worker_urls: list[str], log_dir: Path, timeout_s: float
    ) -> None:
        self.options, self.worker_urls, self.log_dir, self.timeout_s = (
            options,
            worker_urls,
            log_dir,
            timeout_s,
        )
        self._launch: Launched | None = None
        self.handle: RouterHandle | None = None

    def _prepare(self) -> tuple[Launched, RouterHandle]:
        from fineenvs.engine.launcher import Launched, free_port

        port = self.options.port or free_port(self.options.host)
        cmd = router_command(
            self.options, self.worker_urls, port=port, prometheus_port=free_port("127.0.0.1")
        )
        url = f"http://{self.options.host}:{port}"
        launch = Launched(
            cmd,
            base_url=url,
            log_path=self.log_dir / "router.log",
            timeout_s=self.timeout_s,
            grace_s=5.0,
            health_paths=(HEALTH_PATH,),
            name="router",
        )
        return launch, RouterHandle(url, self.worker_urls)

    def _attached(self) -> RouterHandle | None:
        if self.options.url is None:
            return None
        self.handle = attach_router(self.options.url)
        return self.handle

    def __enter__(self) -> RouterHandle:
        attached = self._attached()
        if attached is not None:
            return attached
        self._launch, handle = self._prepare()
        handle.pid = self._launch.__enter__().pid
        self.handle = handle
        return handle

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._launch is not None:
            self._launch.__exit__(exc_type, exc, tb)
            self._launch = None

    async def __aenter__(self) -> RouterHandle:
        import asyncio

        attached = await asyncio.to_thread(self._attached)
        if attached is not None:
            return attached
        self._launch, handle = self._prepare()
        handle.pid = (await self._launch.__aenter__()).pid
        self.handle = handle
        return handle

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._launch is not None:
            launch, self._launch = self._launch, None
            await launch.__aexit__(exc_type, exc, tb)


def launch_router(
    options: RouterOptions, worker_urls: list[str], log_dir: Path, timeout_s: float = 60.0
) -> RouterLaunch:
    """vLLM's router in front of ``worker_urls`` (replicas already serving), its log in
    ``log_dir/router.log``; with ``options.url`` set, nothing starts and the block gets
    ``attach_router(options.url)`` (whose replicas are the router's own)."""
    return RouterLaunch(options, list(worker_urls), Path(log_dir), timeout_s)
