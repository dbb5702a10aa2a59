"""What the rest of fineenvs holds on to: an engine URL, its served model name and its weight sync.

Three ways to get one, all usable as ``with`` or ``async with`` (the engine is healthy inside the
block and stopped after it, whatever happens):

- ``launch_transformers_engine("tiny_qwen", log_dir=...)``: the embedded engine as a child process.
- ``launch_vllm(VLLMServeArgs(...), log_dir=...)``: the published vLLM command (its CUDA or CPU build).
- ``attach("http://host:port")``: a server someone else started; nothing is launched or stopped.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager, AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from subprocess import Popen
from types import TracebackType
from typing import TYPE_CHECKING, Literal

import httpx

from fineenvs.engine.launcher import (
    EngineStartError,
    EngineUnavailableError,
    Launched,
    cuda_devices,
    free_port,
    require_cuda,
)
from fineenvs.engine.vllm import (
    VLLMServeArgs,
    build_serve_command,
    build_serve_env,
    prepare_chat_template,
    vllm_executable_problem,
)
from fineenvs.engine.weights import EmbeddedWeightSync, WeightSync, vllm_weight_sync

if TYPE_CHECKING:
    from fineenvs.engine.replicas import ReplicaSet

EngineKind = Literal["transformers", "vllm", "attached"]


@dataclass
class EngineHandle:
    url: str
    """Base URL without ``/v1`` (``http://127.0.0.1:8000``)."""
    served_model_name: str
    kind: EngineKind
    weight_sync: WeightSync | None = None
    log_path: Path | None = None
    pid: int | None = None
    scratch_dir: Path | None = None
    """The launched server's own temporary directory (vLLM's IPC sockets), removed when it stops."""
    replicas: ReplicaSet | None = None
    """Several servers behind a router (``url`` is the router's): their direct URLs and control."""

    @property
    def openai_base_url(self) -> str:
        return self.url + "/v1"

    # An attached handle is its own context manager (nothing to start or stop but the weight
    # sync's client), so callers treat all three kinds alike: `with build(...) as engine`.
    def __enter__(self) -> EngineHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.weight_sync is not None:
            self.weight_sync.close()

    async def __aenter__(self) -> EngineHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.__exit__()


def served_models(url: str, client: httpx.Client | None = None, timeout_s: float = 10.0) -> list[str]:
    """Model ids listed by ``GET /v1/models``."""
    own = client is None
    http = client or httpx.Client(timeout=timeout_s)
    try:
        response = http.get(url.rstrip("/") + "/v1/models")
        response.raise_for_status()
        return [str(entry["id"]) for entry in response.json().get("data", [])]
    finally:
        if own:
            http.close()


def attach(
    url: str,
    served_model_name: str | None = None,
    *,
    weight_sync: WeightSync | None = None,
    client: httpx.Client | None = None,
) -> EngineHandle:
    """Use a running server; learns the served name from ``/v1/models`` and checks a given one."""
    url = url.rstrip("/").removesuffix("/v1")
    try:
        names = served_models(url, client)
    except httpx.HTTPError as exc:
        raise ConnectionError(unreachable_problem(url, exc)) from exc
    problem = served_model_problem(url, served_model_name, names)
    if problem:
        raise ValueError(problem)
    return EngineHandle(
        url=url, served_model_name=served_model_name or names[0], kind="attached", weight_sync=weight_sync
    )


def unreachable_problem(url: str, error: Exception) -> str:
    return (
        f"engine.url={url}: GET /v1/models failed ({error}). Start the server first, or drop engine.url "
        "to let fineenvs launch one."
    )


def served_model_problem(url: str, served_model_name: str | None, names: list[str]) -> str | None:
    """What is wrong with using ``served_model_name`` (None: the only one) of a server serving
    ``names``; the dry run's preflight asks the same of ``engine.url`` before anything starts."""
    if served_model_name is None and len(names) != 1:
        return (
            f"engine.url={url} serves {len(names)} models ({', '.join(names) or 'none'}); a run attaches to "
            "a server of one model: serve only the run's model there (from Python: attach(url, served_model_name=...))"
        )
    if served_model_name is not None and served_model_name not in names:
        return (
            f"engine.served_model_name={served_model_name!r} is not served by {url} "
            f"(it serves: {', '.join(names) or 'nothing'})."
        )
    return None


Build = Callable[[int], tuple[list[str], dict[str, str] | None, EngineHandle]]
"""port -> (command, environment or None to inherit, handle): one launch attempt."""

_PORT_TRIES = 3


def _port_taken(exc: EngineStartError) -> bool:
    return "address already in use" in str(exc).lower()


class EngineLaunch(AbstractContextManager[EngineHandle], AbstractAsyncContextManager[EngineHandle]):
    """A launched engine as a context manager, sync or async; the handle is valid inside the block.

    With ``port=0`` a free port is picked at entry. Another process can take it before the server
    binds (tests and sweeps start engines concurrently); the child then dies with "address already
    in use", and a new port is tried, up to three times."""

    def __init__(
        self, *, build: Build, host: str, port: int, log_path: Path, timeout_s: float, grace_s: float
    ) -> None:
        self.build, self.host, self.port, self.log_path = build, host, port, log_path
        self.timeout_s, self.grace_s = timeout_s, grace_s
        self.handle: EngineHandle | None = None
        self._launch: Launched | None = None

    def _attempts(self) -> Iterator[tuple[Launched, EngineHandle, bool]]:
        """Each try's launch and handle, and whether another port may follow if its port is taken."""
        for attempt in range(_PORT_TRIES):
            cmd, env, handle = self.build(self.port or free_port(self.host))
            yield self._launched(cmd, env, handle), handle, self.port == 0 and attempt + 1 < _PORT_TRIES

    def _launched(self, cmd: list[str], env: dict[str, str] | None, handle: EngineHandle) -> Launched:
        return Launched(
            cmd,
            base_url=handle.url,
            log_path=self.log_path,
            env=env,
            timeout_s=self.timeout_s,
            grace_s=self.grace_s,
            name=f"{handle.kind} engine",
        )

    @contextmanager
    def _retrying(self, handle: EngineHandle, may_retry: bool) -> Iterator[None]:
        """Around starting one try: if it fails or is interrupted, release what it holds (its weight
        sync, its scratch folder), and swallow the failure when its port was taken and another
        port may be tried."""
        try:
            yield
        except BaseException as exc:
            if handle.weight_sync is not None:
                handle.weight_sync.close()
            _remove_scratch(handle)
            if not (may_retry and isinstance(exc, EngineStartError) and _port_taken(exc)):
                raise

    @property
    def process(self) -> Popen[bytes] | None:
        """The server's process while it runs (None before the start and after the stop)."""
        return self._launch.proc if self._launch is not None else None

    def _started(self, launch: Launched, handle: EngineHandle, proc: Popen[bytes]) -> EngineHandle:
        self._launch, self.handle, handle.pid = launch, handle, proc.pid
        return handle

    @contextmanager
    def _stopping(self) -> Iterator[Launched]:
        """Around stopping the engine: its weight sync closes first and its scratch folder goes
        last, each step running whatever the ones before it raised."""
        assert self._launch is not None and self.handle is not None
        handle = self.handle
        try:
            try:
                if handle.weight_sync is not None:
                    handle.weight_sync.close()
            finally:
                yield self._launch  # the engine stops here, even when closing the weight sync failed
        finally:
            _remove_scratch(handle)

    def start(self) -> None:
        """Start the server on a fixed port without waiting (``wait`` waits): replicas start
        together and load their models side by side. The process is tied to this thread."""
        if self.port == 0:
            raise ValueError(
                "EngineLaunch.start needs a fixed port (a taken free port is retried only by `with`)"
            )
        cmd, env, handle = self.build(self.port)
        launch = self._launched(cmd, env, handle)
        with self._retrying(handle, may_retry=False):
            self._started(launch, handle, launch._start())

    def wait(self) -> EngineHandle:
        """Block until the server started by ``start`` is healthy; stop it if it never is."""
        assert self._launch is not None and self.handle is not None and self._launch.proc is not None
        try:
            self._launch._wait_healthy(self._launch.proc)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self.handle

    def __enter__(self) -> EngineHandle:
        for launch, handle, may_retry in self._attempts():
            with self._retrying(handle, may_retry):
                return self._started(launch, handle, launch.__enter__())
        raise AssertionError("unreachable: the last attempt re-raises")

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        with self._stopping() as launch:
            launch.__exit__(exc_type, exc, tb)

    async def __aenter__(self) -> EngineHandle:
        for launch, handle, may_retry in self._attempts():
            with self._retrying(handle, may_retry):
                return self._started(launch, handle, await launch.__aenter__())
        raise AssertionError("unreachable: the last attempt re-raises")

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        with self._stopping() as launch:
            await launch.__aexit__(exc_type, exc, tb)


def _remove_scratch(handle: EngineHandle) -> None:
    if handle.scratch_dir is not None:
        shutil.rmtree(handle.scratch_dir, ignore_errors=True)


def launch_transformers_engine(
    model: str,
    *,
    log_dir: Path,
    port: int = 0,
    host: str = "127.0.0.1",
    served_model_name: str | None = None,
    seed: int = 0,
    dtype: str = "float32",
    max_queue: int | None = None,
    max_model_len: int | None = None,
    tool_call_parser: str | None = None,
    policy: str | None = None,
    prefix_cache_mib: int | None = None,
    replica_name: str | None = None,
    python: str | None = None,
    timeout_s: float = 180.0,
    grace_s: float = 10.0,
) -> EngineLaunch:
    """The embedded engine (``python -m fineenvs.engine serve``) with its log in ``log_dir``.
    ``model`` is a tiny model name or a local HF directory; None options keep the server's defaults;
    ``port=0`` picks a free port."""
    optional = {
        "--served-model-name": served_model_name,
        "--max-queue": max_queue,
        "--max-model-len": max_model_len,
        "--tool-call-parser": tool_call_parser,
        "--policy": policy,
        "--prefix-cache-mib": prefix_cache_mib,
        "--replica-name": replica_name,
    }

    def build(chosen: int) -> tuple[list[str], dict[str, str] | None, EngineHandle]:
        cmd = [python or sys.executable, "-m", "fineenvs.engine", "serve", "--model", model]
        cmd += ["--host", host, "--port", str(chosen), "--seed", str(seed), "--dtype", dtype]
        for flag, value in optional.items():
            if value is not None:
                cmd += [flag, str(value)]
        url = f"http://{host}:{chosen}"
        handle = EngineHandle(
            url=url,
            served_model_name=served_model_name or model,
            kind="transformers",
            weight_sync=EmbeddedWeightSync(url, log_dir / "weights"),
            log_path=log_dir / "engine.log",
        )
        return cmd, None, handle

    return EngineLaunch(
        build=build,
        host=host,
        port=port,
        log_path=log_dir / "engine.log",
        timeout_s=timeout_s,
        grace_s=grace_s,
    )


def launch_vllm(
    args: VLLMServeArgs,
    log_dir: Path,
    *,
    timeout_s: float = 1800.0,
    grace_s: float = 30.0,
    check_gpu: Callable[[], list[str]] | None = None,
) -> EngineLaunch:
    """The published vLLM command, on GPUs or on vLLM's CPU build (``args.platform``). On the
    ``cuda`` platform it refuses a machine without enough GPUs before writing or starting anything
    (``args.devices``, when given, are the GPUs counted: the server's own ``CUDA_VISIBLE_DEVICES``);
    writes the patched chat template into ``args.chat_template_dir`` (or ``log_dir``) when
    ``args.chat_template`` is None; ``args.port=0`` picks a free port."""
    if args.platform == "cuda":
        if check_gpu is None:
            env = (
                None
                if args.devices is None
                else {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(args.devices)}
            )
            gpus = require_cuda(devices=cuda_devices(env=env))
        else:
            gpus = check_gpu()
        needed = args.tensor_parallel_size * args.data_parallel_size
        if len(gpus) < needed:
            raise EngineUnavailableError(
                f"engine.tensor_parallel_size x engine.data_parallel_size = {needed} GPUs, but {len(gpus)} "
                f"visible ({'; '.join(gpus)}). Lower engine.data_parallel_size or engine.tensor_parallel_size, "
                "or make more GPUs visible (CUDA_VISIBLE_DEVICES)."
            )
    problem = vllm_executable_problem(args)
    if problem:
        raise FileNotFoundError(problem)
    prepared = prepare_chat_template(args, log_dir)

    def build(chosen: int) -> tuple[list[str], dict[str, str] | None, EngineHandle]:
        served = replace(prepared, port=chosen)
        weight_sync = vllm_weight_sync(
            served.weight_sync, served.url, log_dir / "weights", log_dir / "vllm.log"
        )
        env = build_serve_env(served)
        scratch = None
        if "VLLM_RPC_BASE_PATH" not in env:
            # vLLM's ZMQ sockets would otherwise stay in /tmp after every stop, one set per start.
            # Not under log_dir: a socket path has at most 107 bytes.
            scratch = Path(tempfile.mkdtemp(prefix="fineenvs-vllm-"))
            env["VLLM_RPC_BASE_PATH"] = str(scratch)
        handle = EngineHandle(
            url=served.url,
            served_model_name=served.name,
            kind="vllm",
            weight_sync=weight_sync,
            log_path=log_dir / "vllm.log",
            scratch_dir=scratch,
        )
        return build_serve_command(served), env, handle

    return EngineLaunch(
        build=build,
        host=args.host,
        port=args.port,
        log_path=log_dir / "vllm.log",
        timeout_s=timeout_s,
        grace_s=grace_s,
    )
