"""Start an engine server as a child process, wait until it serves, and always stop it.

The child runs in its own process group (vLLM forks engine-core and worker processes; a group
signal reaches all of them) with stdout and stderr in a log file in the run's output folder. On
exit from the context, including Ctrl-C and errors, the group gets SIGTERM, then SIGKILL after a
grace period. As a second line of defence, children still running at interpreter exit are stopped
by an ``atexit`` hook, and on Linux the child gets SIGTERM if the thread that started it dies.

``require_cuda`` refuses to launch vLLM on a machine without an NVIDIA GPU before anything starts.
"""

from __future__ import annotations

import asyncio
import atexit
import ctypes
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from pathlib import Path
from types import TracebackType

import httpx

HEALTH_PATHS = ("/health", "/v1/models")


class EngineStartError(RuntimeError):
    """The engine process died or never became healthy; the message carries its log tail."""


class EngineUnavailableError(RuntimeError):
    """The requested engine cannot run on this machine (for example vLLM without a GPU)."""


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log written)"
    return "\n".join(text.splitlines()[-lines:]) or "(log is empty)"


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (another process may still take it before the server)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


# --- GPU check --------------------------------------------------------------------------------


def cuda_devices(
    nvidia_smi: str | None = None, device_glob: str = "/dev/nvidia[0-9]*", env: dict[str, str] | None = None
) -> tuple[list[str], str]:
    """Visible NVIDIA GPUs and, when there are none, why. Reads no torch: vLLM may run from another
    venv, so the trainer's torch (possibly a CPU wheel) says nothing about the machine."""
    env = dict(os.environ) if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return [], f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
    smi = nvidia_smi if nvidia_smi is not None else shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return [], f"`{smi} -L` failed: {exc}"
        gpus = [line for line in out.stdout.splitlines() if line.startswith("GPU ")]
        if visible is not None:
            # nvidia-smi lists every GPU; CUDA_VISIBLE_DEVICES (indices or UUIDs) is what vLLM sees.
            wanted = [v.strip() for v in visible.split(",") if v.strip()]
            uuids = [w for w in wanted if not w.isdigit()]
            gpus = [g for i, g in enumerate(gpus) if str(i) in wanted or any(u in g for u in uuids)]
        if gpus:
            return gpus, ""
        return [], f"`{smi} -L` lists no GPU ({(out.stderr or out.stdout).strip()[:200]})"
    nodes = sorted(glob.glob(device_glob))
    if nodes:
        return nodes, ""
    return [], "nvidia-smi is not on PATH and there is no /dev/nvidia* device"


def require_cuda(what: str = "engine=vllm", devices: tuple[list[str], str] | None = None) -> list[str]:
    gpus, reason = devices if devices is not None else cuda_devices()
    if gpus:
        return gpus
    raise EngineUnavailableError(
        f"{what} on the cuda platform needs an NVIDIA GPU, but none is usable here: {reason}. "
        "Without a GPU: engine.platform=cpu (or auto) serves with vLLM's CPU build (install it with "
        "`python -m fineenvs.engine install-vllm`); engine=transformers is the embedded engine; "
        "engine.url=http://HOST:PORT attaches to a vLLM server started elsewhere."
    )


# --- process lifecycle ------------------------------------------------------------------------

_RUNNING: dict[int, subprocess.Popen[bytes]] = {}


def _stop_all_at_exit() -> None:
    for proc in list(_RUNNING.values()):
        stop_process(proc, grace_s=5.0)


atexit.register(_stop_all_at_exit)


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: PR_SET_PDEATHSIG (1) sends SIGTERM to the child when
    # the parent thread exits, so a SIGKILLed trainer does not leave a GPU-holding server behind.
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)


def start_process(
    cmd: Sequence[str], *, log_path: Path, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in a new process group with stdout+stderr appended to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        try:
            proc = subprocess.Popen(
                list(cmd),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=cwd,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        except FileNotFoundError as exc:
            raise EngineStartError(f"Cannot start {cmd[0]!r}: {exc.strerror} ({exc.filename}).") from exc
    _RUNNING[proc.pid] = proc
    return proc


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> int | None:
    """SIGTERM the process group, SIGKILL it after ``grace_s``; returns the exit code."""
    _RUNNING.pop(proc.pid, None)
    if proc.poll() is None:
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    # The leader may be gone while its forks (vLLM engine-core, workers) still run: kill the group.
    _signal_group(proc, signal.SIGKILL)
    try:
        return proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        return None


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)  # start_new_session=True: the group id is the child's pid
    except (ProcessLookupError, PermissionError):
        pass


def _healthy(client: httpx.Client, base_url: str, paths: Sequence[str]) -> bool:
    for path in paths:
        try:
            if client.get(base_url + path).status_code != 200:
                return False
        except httpx.HTTPError:
            return False
    return True


def wait_healthy(
    proc: subprocess.Popen[bytes],
    base_url: str,
    *,
    log_path: Path,
    timeout_s: float,
    paths: Sequence[str] = HEALTH_PATHS,
    poll_s: float = 0.25,
    name: str = "engine",
) -> None:
    """Block until every path in ``paths`` answers 200; fail fast if the process exits first."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0) as client:
        while True:
            code = proc.poll()
            if code is not None:
                raise EngineStartError(
                    f"The {name} process exited with code {code} before serving {base_url}. "
                    f"Last lines of {log_path}:\n{log_tail(log_path)}"
                )
            if _healthy(client, base_url, paths):
                return
            if time.monotonic() > deadline:
                raise EngineStartError(
                    f"The {name} did not answer {', '.join(paths)} on {base_url} within {timeout_s:.0f} s "
                    f"(raise engine.startup_timeout_s if the model is large). Last lines of {log_path}:\n"
                    f"{log_tail(log_path)}"
                )
            time.sleep(poll_s)


class Launched(
    AbstractContextManager[subprocess.Popen[bytes]], AbstractAsyncContextManager[subprocess.Popen[bytes]]
):
    """``cmd`` running for the duration of a ``with`` or ``async with`` block, healthy on entry,
    stopped on any exit. Under ``async with`` the process starts on the loop thread (so the
    parent-death signal is tied to a long-lived thread); the blocking waits run in worker threads."""

    def __init__(
        self,
        cmd: Sequence[str],
        *,
        base_url: str,
        log_path: Path,
        env: dict[str, str] | None = None,
        timeout_s: float = 600.0,
        grace_s: float = 10.0,
        health_paths: Sequence[str] = HEALTH_PATHS,
        name: str = "engine",
        before_start: Callable[[], None] | None = None,
    ) -> None:
        self.cmd, self.base_url, self.log_path, self.env = cmd, base_url, log_path, env
        self.timeout_s, self.grace_s, self.health_paths, self.name = timeout_s, grace_s, health_paths, name
        self.before_start = before_start
        self.proc: subprocess.Popen[bytes] | None = None

    def _start(self) -> subprocess.Popen[bytes]:
        if self.before_start is not None:
            self.before_start()
        self.proc = start_process(self.cmd, log_path=self.log_path, env=self.env)
        return self.proc

    def _wait_healthy(self, proc: subprocess.Popen[bytes]) -> None:
        wait_healthy(
            proc,
            self.base_url,
            log_path=self.log_path,
            timeout_s=self.timeout_s,
            paths=self.health_paths,
            name=self.name,
        )

    def _stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, grace_s=self.grace_s)

    def __enter__(self) -> subprocess.Popen[bytes]:
        proc = self._start()
        try:
            self._wait_healthy(proc)
        except BaseException:
            self._stop()
            raise
        return proc

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop()

    async def __aenter__(self) -> subprocess.Popen[bytes]:
        proc = self._start()
        try:
            await asyncio.to_thread(self._wait_healthy, proc)
        except BaseException:
            await asyncio.shield(asyncio.to_thread(self._stop))
            raise
        return proc

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await asyncio.shield(asyncio.to_thread(self._stop))


launched = Launched
"""Run a command for the duration of a ``with`` block (the name callers know)."""
launched_async = Launched
"""``launched`` for ``async with``: one class serves both."""
