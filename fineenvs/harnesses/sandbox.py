"""One attempt of one harness, isolated: fresh HOME and workdir, env from scratch, process group, timeout.

Layout of an attempt folder::

    attempt_dir/home/        HOME of the agent (its config files, logs, trajectories)
    attempt_dir/work/        working directory (task inputs copied in; answer.txt expected here)
    attempt_dir/stdout.txt   agent stdout        attempt_dir/stderr.txt  agent stderr
    attempt_dir/attempt.json command line (task prompt included), env variable NAMES, result

While the agent runs, its working directory is not ``attempt_dir/work`` but a neutral one,
``<tmp>/fineenvs-work/<8 hex>``, moved to ``attempt_dir/work`` when the attempt ends. Agents put
their working directory into the prompt (Pi, OpenCode, Claude Code, Codex, Gemini CLI): a path
like ``runs/x/eval/checkpoints_step-108/attempts/t00002-pi-try0/work`` tells the model which job
it is in (teacher collection, RL, evaluation) and differs between them. A tiny student trained on
teacher rollouts wrote garbage under evaluation paths and sensible commands under training ones;
every attempt now sees the same kind of path, as in a container's fixed working directory.

Two modes:

* plain (default): separate HOME/workdir, an environment holding only PATH/HOME/locale, the
  session key and the agent's switches (the parent's API keys never reach it), its own process
  group plus an attempt marker in its environment, so that on exit or timeout the whole group and
  any process that escaped it (``setsid``) is killed. The agent still runs as the same user with the
  host's filesystem and network.
* bwrap (``use_bwrap=True``): additionally a read-only view of the host's root, a private /tmp,
  writable only the attempt folder and the working directory, new PID/IPC/UTS namespaces and a
  private network namespace that has only loopback; the proxy's host:port is reachable inside through a Unix-socket bridge, nothing
  else is. HOME and the working directory appear at fixed paths (``/tmp/home``, ``/tmp/work``),
  so every attempt of a harness sends the same prompt up to its task (``SANDBOX_HOME``).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING
from urllib.parse import urlsplit

from fineenvs.harnesses.base import Harness, Launch, Outputs
from fineenvs.harnesses.files import read_text
from fineenvs.harnesses.guard import (
    CONTAINER_ENV,
    DOCKER_CLIENT_ENV,
    MARKER_ENV,
    RUN_MARKER_ENV,
    alive,
    pids_with_env,
)
from fineenvs.jsonl import JsonObject

if TYPE_CHECKING:
    from fineenvs.harnesses.container import DockerSettings
    from fineenvs.harnesses.netbridge import UnixToTcp

ANSWER_FILE = "answer.txt"
KILL_GRACE_SECONDS = 3.0

WORK_ROOT_NAME = "fineenvs-work"

EXIT_REASONS = (
    "finished",
    "timeout",
    "crashed",
    "budget_stop",
    "context_overflow",
    "wiring_failure",
    "infra_failure",
)
"""``infra_failure``: the sandbox itself did not start (no docker daemon, an image that did not
build, ``docker run`` failing before the agent ran, bwrap unable to set up its namespaces): the
machinery's fault, never the agent's (the rollout runner raises it as ``InfrastructureFailure``)."""


@dataclass(frozen=True)
class ProxyStats:
    """What the proxy saw of one session (filled by the caller, e.g. :func:`proxy_stats_from_rollout`)."""

    model_calls: int
    tool_calls: int
    budget_stops: int = 0
    context_stops: int = 0


@dataclass
class AttemptResult:
    harness: str
    exit_reason: str
    returncode: int | None
    duration_s: float
    answer: str | None
    final_text: str | None
    proxy_model_calls: int | None
    proxy_tool_calls: int | None
    native_tool_calls: int | None
    tool_calls_disagree: bool
    attempt_dir: str
    leftover_pids: list[int] = field(default_factory=list)
    detail: str = ""

    def to_json(self) -> JsonObject:
        return asdict(self)


def classify(*, timed_out: bool, returncode: int | None, stats: ProxyStats | None) -> str:
    """Exit reason; a proxy-enforced stop is the cause even when the agent then crashed or hung."""
    if stats is not None:
        if stats.budget_stops:
            return "budget_stop"
        if stats.context_stops:
            return "context_overflow"
        if stats.model_calls == 0:
            return "wiring_failure"
    if timed_out:
        return "timeout"
    return "finished" if returncode == 0 else "crashed"


def _pids_with_marker(marker: str) -> list[int]:
    """Processes whose environment carries this attempt's marker (children inherit it)."""
    return pids_with_env(MARKER_ENV, marker, {os.getpid()})


def _pids_in_group(pgid: int) -> list[int]:
    found: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command: state ppid pgrp ...
        rest = stat.rsplit(")", 1)[-1].split()
        if len(rest) > 2 and rest[2] == str(pgid) and rest[0] != "Z":
            found.append(int(entry.name))
    return found


_alive = alive


GUARD = Path(__file__).with_name("guard.py")
_LIVE: dict[int, str] = {}  # guard pid (= its process group) -> attempt marker, while running
_LIVE_LOCK = threading.Lock()


def guarded(argv: list[str], marker: str) -> list[str]:
    """``argv`` under the attempt's guard (``fineenvs.harnesses.guard``): the agent's process
    tree dies with this process, even when this process is SIGKILLed."""
    return [sys.executable, "-I", str(GUARD), str(os.getpid()), marker, "--", *argv]


def stop_live_attempts() -> int:
    """Ask every running attempt's guard to take its agent down (returns at once; the attempts'
    own threads then see their agents exit and finish as usual). Returns how many were running."""
    with _LIVE_LOCK:
        live = list(_LIVE)
    for pgid in live:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    return len(live)


def kill_attempt(pgid: int, marker: str, *, grace: float = KILL_GRACE_SECONDS) -> list[int]:
    """SIGTERM then SIGKILL the process group and every marked process; return pids still alive."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in _pids_with_marker(marker):
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 2.0)
        while time.monotonic() < deadline:
            if not [p for p in _pids_in_group(pgid) + _pids_with_marker(marker) if _alive(p)]:
                return []
            time.sleep(0.05)
    return sorted({p for p in _pids_in_group(pgid) + _pids_with_marker(marker) if _alive(p)})


def _keep_under_tmp() -> list[str]:
    """Read-only binds for what the agent needs that lives under /tmp (a checkout, its venv, the
    harness cache), which the private /tmp would otherwise hide."""
    from fineenvs.paths import REPO_ROOT, harness_cache

    needed = {Path(sys.prefix), Path(sys.base_prefix), harness_cache(), REPO_ROOT}
    args: list[str] = []
    for path in sorted(p.resolve() for p in needed):
        if path.is_relative_to("/tmp") and path != Path("/tmp"):
            args += ["--ro-bind", str(path), str(path)]
    return args


def neutral_workdir() -> Path:
    """A fresh, empty working directory whose path says nothing about the run (``<tmp>/fineenvs-work/<8 hex>``)."""
    root = Path(tempfile.gettempdir()).resolve() / WORK_ROOT_NAME  # resolved: inputs are checked against it
    root.mkdir(mode=0o700, exist_ok=True)
    while True:
        path = root / secrets.token_hex(4)
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            continue
        return path


# Where HOME and the working directory appear inside a bwrap sandbox: the same for every attempt,
# as in a container. Agents write both into their prompts (Claude Code's memory folder 500 tokens
# into a 20k-token system prompt, Codex's skill roots, every agent's working directory), so with
# per-attempt paths no two attempts share more than that opening, and the engine's prefix cache
# and prefix-shared training have nothing to share; with fixed ones, the attempts of a harness send
# the same tokens up to the task.
SANDBOX_HOME = Path("/tmp/home")
SANDBOX_WORK = Path("/tmp/work")
SANDBOX_BRIDGE = Path("/tmp/.fineenvs-bridge")  # the proxy's Unix socket, inside the sandbox


def _proxy_bridge(base_url: str, mode: str) -> tuple[UnixToTcp, Path, Path, int]:
    """The outside half of the proxy bridge: (bridge, its socket folder, the socket, the proxy's port)."""
    from fineenvs.harnesses.netbridge import UnixToTcp

    parts = urlsplit(base_url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    if host not in ("127.0.0.1", "localhost"):
        raise RuntimeError(f"{mode} mode reaches the proxy over loopback only; base_url host is {host!r}")
    # A Unix socket path must fit in 108 bytes (sun_path), which attempt folders deep in an output
    # directory do not: the socket lives in a short private host folder, bound to a fixed short
    # path inside the sandbox.
    sock_dir = Path(tempfile.mkdtemp(prefix="fineenvs-br-"))
    sock = sock_dir / "proxy.sock"
    if len(str(sock).encode()) > 107:  # sun_path holds 108 bytes with the terminating NUL
        sock_dir.rmdir()
        raise RuntimeError(
            f"the sandbox's proxy socket path {sock} is longer than a Unix socket allows (108 bytes): "
            "TMPDIR is too deep. Fix: set TMPDIR to a short folder, e.g. TMPDIR=/tmp"
        )
    return UnixToTcp(str(sock), host, port, cleanup_dir=str(sock_dir)), sock_dir, sock, port


def _bwrap_wrap(
    argv: list[str], *, attempt_dir: Path, workdir: Path, base_url: str
) -> tuple[list[str], UnixToTcp]:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise RuntimeError("use_bwrap=True but bwrap is not installed; apt-get install bubblewrap")
    bridge, sock_dir, sock, port = _proxy_bridge(base_url, "bwrap")
    wrapped = [
        bwrap,
        "--ro-bind", "/", "/",
        "--dev", "/dev",
        "--proc", "/proc",
        "--tmpfs", "/tmp",
        *_keep_under_tmp(),
        "--bind", str(attempt_dir), str(attempt_dir),
        "--bind", str(workdir), str(workdir),
        "--bind", str(attempt_dir / "home"), str(SANDBOX_HOME),
        "--bind", str(workdir), str(SANDBOX_WORK),
        "--bind", str(sock_dir), str(SANDBOX_BRIDGE),
        "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
        "--die-with-parent",
        "--chdir", str(SANDBOX_WORK),
        sys.executable if Path(sys.executable).exists() else "python3",
        "-I", str(Path(__file__).with_name("netbridge.py")), str(port), str(SANDBOX_BRIDGE / sock.name), "--",
        *argv,
    ]  # fmt: skip
    return wrapped, bridge


@dataclass(frozen=True)
class _ContainerPlan:
    settings: DockerSettings
    task_id: str | None
    environment: Path | None


def _docker_wrap(
    argv: list[str],
    env: dict[str, str],
    plan: _ContainerPlan,
    *,
    marker: str,
    home: Path,
    workdir: Path,
    base_url: str,
) -> tuple[list[str], dict[str, str], UnixToTcp, str]:
    """``argv`` as a ``docker run`` (see ``fineenvs.harnesses.container``): the command, the docker
    client's environment (the agent's variables, passed on by name, plus what the client itself
    needs), the proxy bridge and the container's name."""
    from fineenvs.harnesses import container as ct

    problem = ct.node_problem(plan.settings)  # here, where the container runs (a Ray node, or this machine)
    if problem:
        raise ct.DockerUnavailable(problem)
    image = ct.image_for(plan.settings, task_id=plan.task_id, environment=plan.environment)
    name = f"fineenvs-{marker[:16]}"
    bridge, sock_dir, sock, port = _proxy_bridge(base_url, "docker")
    wrapped = ct.docker_argv(
        argv,
        settings=plan.settings,
        image=image,
        name=name,
        attempt_id=marker,
        home=home,
        workdir=workdir,
        sock_dir=sock_dir,
        sock_name=sock.name,
        port=port,
        env_names=sorted(env),
        sandbox_home=SANDBOX_HOME,
        sandbox_work=SANDBOX_WORK,
        sandbox_bridge=SANDBOX_BRIDGE,
    )
    # Only the client reads these; the container gets the names listed with -e above.
    client = {k: os.environ[k] for k in ("DOCKER_HOST", "DOCKER_CONFIG", "DOCKER_CONTEXT") if k in os.environ}
    # The client runs with the agent's HOME (/tmp/home, a host path any local user can create):
    # its config, which can name another daemon, comes from the user running fineenvs instead.
    client.setdefault("DOCKER_CONFIG", str(Path.home() / ".docker"))
    # The guard removes the container when the run dies: with this client (its PATH is the agent's).
    guard = {CONTAINER_ENV: name, DOCKER_CLIENT_ENV: wrapped[0]}
    return wrapped, {**env, **client, **guard}, bridge, name


def _container_outcome(
    run: _AgentRun, name: str, plan: _ContainerPlan | None, attempt_dir: Path
) -> tuple[_AgentRun, bool, str]:
    """The run, with a kill for memory recorded as its failure, whether there was one, and docker's
    own error where the container never started (empty otherwise); the container is removed."""
    from fineenvs.harnesses.container import container_end, startup_failure

    end = container_end(name)
    if run.returncode is not None and not run.timed_out:
        failed = startup_failure(run.returncode, end, read_text(attempt_dir / "stderr.txt"))
        if failed:
            return replace(run, detail="; ".join(x for x in (failed, run.detail) if x)), False, failed
    if not end.oom:
        return run, False, ""
    limit = plan.settings.memory if plan is not None else "?"
    detail = (
        f"out of memory: the container was killed at its memory limit (scheduler.docker.memory={limit}); "
        "raise it, e.g. scheduler.docker.memory=8g"
    )
    return replace(run, detail="; ".join(x for x in (detail, run.detail) if x)), True, ""


def _bwrap_failure(run: _AgentRun, attempt_dir: Path) -> str:
    """bwrap's own error where it could not set up the sandbox (it then exits 1 having written only
    ``bwrap: <why>``, before the agent ran), else empty. An agent that exits 1 writes its own stderr."""
    if run.returncode != 1 or run.timed_out:
        return ""
    lines = read_text(attempt_dir / "stderr.txt").strip().splitlines()
    if len(lines) == 1 and lines[0].startswith("bwrap: "):
        return f"the bwrap sandbox did not start: {lines[0]}"
    return ""


def run_attempt(
    harness: Harness,
    *,
    task_prompt: str,
    input_files: Mapping[str, Path],
    attempt_dir: Path,
    base_url: str,
    session_key: str,
    model: str,
    api_format: str | None = None,
    timeout_seconds: float,
    step_limit: int | None = None,
    use_bwrap: bool = False,
    docker: DockerSettings | None = None,
    task_id: str | None = None,
    environment: Path | None = None,
    proxy_stats: Callable[[], ProxyStats | None] | None = None,
) -> AttemptResult:
    """Run ``harness`` once on ``task_prompt`` in a fresh HOME/workdir under ``attempt_dir``.

    ``proxy_stats`` is called after the agent has exited (and its process group is gone) and
    returns what the proxy recorded for this attempt's session; it decides budget stops, context
    overflows and wiring failures and gives the proxy-side tool-call count.

    ``docker`` set: the agent runs in a container (``fineenvs.harnesses.container``), in the image
    of the task's ``environment`` folder where it has a Dockerfile.
    """
    fmt = harness.check_format(api_format or harness.default_format)
    attempt_dir = attempt_dir.resolve()
    home, kept_workdir = attempt_dir / "home", attempt_dir / "work"
    for d in (home, home / "tmp"):
        d.mkdir(parents=True, exist_ok=True)
    if kept_workdir.exists():  # a rerun of this attempt starts from the task's inputs again
        shutil.rmtree(kept_workdir)
    workdir = neutral_workdir()
    try:
        return _run_in(
            harness,
            fmt,
            task_prompt=task_prompt,
            input_files=input_files,
            attempt_dir=attempt_dir,
            home=home,
            workdir=workdir,
            base_url=base_url,
            session_key=session_key,
            model=model,
            timeout_seconds=timeout_seconds,
            step_limit=step_limit,
            use_bwrap=use_bwrap,
            container=None if docker is None else _ContainerPlan(docker, task_id, environment),
            proxy_stats=proxy_stats,
        )
    finally:
        if workdir.exists():
            _keep_workdir(workdir, kept_workdir)


def _keep_workdir(workdir: Path, kept: Path) -> None:
    """Move the neutral working directory into the attempt folder; never lose the attempt over it."""
    try:
        shutil.move(str(workdir), str(kept))
    except (OSError, shutil.Error):
        # Across filesystems ``move`` copies, and a FIFO or socket the agent left there fails the
        # copy: keep the regular files, directories and links.
        def special(folder: str, names: list[str]) -> list[str]:
            paths = [Path(folder, n) for n in names]
            return [p.name for p in paths if not (p.is_symlink() or p.is_file() or p.is_dir())]

        shutil.copytree(workdir, kept, symlinks=True, dirs_exist_ok=True, ignore=special)
        shutil.rmtree(workdir, ignore_errors=True)


def _run_in(
    harness: Harness,
    fmt: str,
    *,
    task_prompt: str,
    input_files: Mapping[str, Path],
    attempt_dir: Path,
    home: Path,
    workdir: Path,
    base_url: str,
    session_key: str,
    model: str,
    timeout_seconds: float,
    step_limit: int | None,
    use_bwrap: bool,
    container: _ContainerPlan | None,
    proxy_stats: Callable[[], ProxyStats | None] | None,
) -> AttemptResult:
    _copy_inputs(input_files, workdir)
    launch = Launch(home, workdir, base_url, session_key, model, fmt, step_limit, task_prompt)
    harness.write_config(launch)
    # Config files are written where they live on the host; the command line and the environment
    # name the paths the agent sees (fixed ones inside bwrap, the same folders mounted there).
    fixed_paths = use_bwrap or container is not None
    seen = launch.seen_as(SANDBOX_HOME, SANDBOX_WORK) if fixed_paths else launch
    argv = harness.command(seen)
    marker = uuid.uuid4().hex
    env = harness.env(seen)
    bridge: UnixToTcp | None = None
    container_name = ""
    setup_error = ""
    if container is not None:
        try:
            argv, env, bridge, container_name = _docker_wrap(
                argv, env, container, marker=marker, home=home, workdir=workdir, base_url=base_url
            )
        except Exception as exc:  # noqa: BLE001 - no image (a failed build, no daemon): the attempt's failure
            setup_error = f"container: {exc}"
    env = _marked_env(env, marker)
    if use_bwrap:
        argv, bridge = _bwrap_wrap(argv, attempt_dir=attempt_dir, workdir=workdir, base_url=base_url)
    record: JsonObject = {
        "harness": harness.name,
        "version": harness.version,
        "api_format": fmt,
        "argv": argv,
        "env_names": sorted(env),
        "bwrap": use_bwrap,
        "container": container_name or None,
        "timeout_seconds": timeout_seconds,
        "step_limit": step_limit,
    }
    (attempt_dir / "attempt.json").write_text(json.dumps(record, indent=2))
    if setup_error:  # the agent never started: its logs say why, where a reader looks first
        (attempt_dir / "stdout.txt").write_bytes(b"")
        (attempt_dir / "stderr.txt").write_text(setup_error + "\n")
        run = _AgentRun(None, False, [], setup_error, 0.0)
    else:
        run = _run_agent(
            argv,
            env,
            marker,
            workdir=workdir,
            attempt_dir=attempt_dir,
            timeout_seconds=timeout_seconds,
            bridge=bridge,
        )
    oom = False
    infra = setup_error  # the sandbox, not the agent, failed: an infrastructure failure
    if container_name:
        run, oom, infra = _container_outcome(run, container_name, container, attempt_dir)
    elif use_bwrap:
        infra = _bwrap_failure(run, attempt_dir)
        if infra:
            run = replace(run, detail="; ".join(x for x in (infra, run.detail) if x))
    result = _attempt_result(harness, run, attempt_dir=attempt_dir, workdir=workdir, proxy_stats=proxy_stats)
    if oom and result.exit_reason == "wiring_failure":  # killed before its first call: not a wiring fault
        result.exit_reason = "crashed"
    if infra:
        result.exit_reason = "infra_failure"
    record["result"] = result.to_json()
    (attempt_dir / "attempt.json").write_text(json.dumps(record, indent=2))
    return result


def _copy_inputs(input_files: Mapping[str, Path], workdir: Path) -> None:
    """The task's input files and folders into the working directory, under their relative names."""
    for rel, src in input_files.items():
        dest = (workdir / rel).resolve()
        if workdir not in dest.parents:
            raise ValueError(f"input file name {rel!r} escapes the working directory; use a relative path")
        dest.parent.mkdir(parents=True, exist_ok=True)
        if Path(src).is_dir():
            shutil.copytree(src, dest, dirs_exist_ok=True)
        else:
            shutil.copy2(src, dest)


def _marked_env(env: dict[str, str], marker: str) -> dict[str, str]:
    """The agent's environment with this attempt's marker, and the run's where there is one."""
    env[MARKER_ENV] = marker
    if os.environ.get(RUN_MARKER_ENV):  # a restarted run reaps what this run leaves behind
        env[RUN_MARKER_ENV] = os.environ[RUN_MARKER_ENV]
    return env


@dataclass(frozen=True)
class _AgentRun:
    """How the agent's process ended: its exit status, whether it ran out of time, what outlived
    it, and why it never started (``detail``, empty where it did)."""

    returncode: int | None
    timed_out: bool
    leftover: list[int]
    detail: str
    duration_s: float


def _run_agent(
    argv: list[str],
    env: dict[str, str],
    marker: str,
    *,
    workdir: Path,
    attempt_dir: Path,
    timeout_seconds: float,
    bridge: UnixToTcp | None,
) -> _AgentRun:
    """Run the agent to its end or its timeout, stdout and stderr into the attempt folder, the
    proxy bridge open meanwhile; then kill what it left behind."""
    started = time.monotonic()
    returncode: int | None = None
    timed_out = False
    leftover: list[int] = []
    detail = ""
    with (attempt_dir / "stdout.txt").open("wb") as out, (attempt_dir / "stderr.txt").open("wb") as err:
        if bridge is not None:
            bridge.__enter__()
        try:
            try:
                proc = _start(argv, env, marker, workdir=workdir, stdout=out, stderr=err)
            except OSError as exc:
                detail = f"could not start {argv[0]}: {exc}"
                proc = None
            if proc is not None:
                returncode, timed_out, leftover = _wait(proc, marker, timeout_seconds)
        finally:
            if bridge is not None:
                bridge.__exit__(None, None, None)
    return _AgentRun(returncode, timed_out, leftover, detail, time.monotonic() - started)


def _start(
    argv: list[str], env: dict[str, str], marker: str, *, workdir: Path, stdout: IO[bytes], stderr: IO[bytes]
) -> subprocess.Popen[bytes]:
    """The agent's process under its guard, in a session of its own (OSError where it cannot start)."""
    exe = argv[0] if os.sep in argv[0] else shutil.which(argv[0], path=env.get("PATH"))
    if exe is None or not os.access(exe, os.X_OK):  # the guard would only exit 127
        raise FileNotFoundError(2, "no such executable on the agent's PATH", argv[0])
    return subprocess.Popen(
        guarded(argv, marker),
        cwd=workdir,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,
    )


def _wait(proc: subprocess.Popen[bytes], marker: str, timeout_seconds: float) -> tuple[int, bool, list[int]]:
    """(exit status, timed out, pids still alive) of the agent, its whole process tree killed."""
    with _LIVE_LOCK:
        _LIVE[proc.pid] = marker
    returncode: int | None = None
    timed_out = False
    try:
        try:
            returncode = proc.wait(timeout=timeout_seconds)
        except subprocess.TimeoutExpired:
            timed_out = True
        # Also after a clean exit: agents leave shells, servers and watchers behind.
        leftover = kill_attempt(proc.pid, marker)
        if returncode is None:
            returncode = proc.wait()
    finally:
        with _LIVE_LOCK:
            _LIVE.pop(proc.pid, None)
    return returncode, timed_out, leftover


def _attempt_result(
    harness: Harness,
    run: _AgentRun,
    *,
    attempt_dir: Path,
    workdir: Path,
    proxy_stats: Callable[[], ProxyStats | None] | None,
) -> AttemptResult:
    """The attempt's result from the agent's exit, its own log, its answer file and the proxy's count."""
    stats: ProxyStats | None = None
    stats_error = ""
    if proxy_stats is not None:
        # A proxy hiccup must not lose the attempt: it is reported, and the exit reason then rests
        # on the agent's own exit status.
        try:
            stats = proxy_stats()
        except Exception as exc:  # noqa: BLE001 - any failure of the caller's query
            stats_error = f"proxy stats unavailable: {type(exc).__name__}: {exc}"
    outputs: Outputs = harness.parse_outputs(attempt_dir)
    answer_path = workdir / ANSWER_FILE
    answer = answer_path.read_text(errors="replace").strip() if answer_path.is_file() else None
    reason = classify(timed_out=run.timed_out, returncode=None if run.detail else run.returncode, stats=stats)
    if run.detail and reason == "finished":
        reason = "crashed"
    proxy_tools = stats.tool_calls if stats is not None else None
    disagree = (
        not harness.actions_in_text
        and proxy_tools is not None
        and outputs.native_tool_calls is not None
        and proxy_tools != outputs.native_tool_calls
    )
    return AttemptResult(
        harness=harness.name,
        exit_reason=reason,
        returncode=run.returncode,
        duration_s=round(run.duration_s, 3),
        answer=answer,
        final_text=outputs.final_text,
        proxy_model_calls=stats.model_calls if stats is not None else None,
        proxy_tool_calls=proxy_tools,
        native_tool_calls=outputs.native_tool_calls,
        tool_calls_disagree=disagree,
        attempt_dir=str(attempt_dir),
        leftover_pids=run.leftover,
        detail="; ".join(x for x in (run.detail, stats_error, outputs.detail) if x),
    )


def count_tool_calls(calls: list[JsonObject]) -> int:
    """Tool calls the model emitted across recorded calls (parsed ``tool_calls`` of each completion)."""
    total = 0
    for call in calls:
        for holder in (call.get("completion"), call.get("response"), call):
            if not isinstance(holder, dict):
                continue
            choices = holder.get("choices")
            if isinstance(choices, list) and choices:
                msg = (choices[0] or {}).get("message") or {}
                total += len(msg.get("tool_calls") or [])
                break
            if isinstance(holder.get("tool_calls"), list):
                total += len(holder["tool_calls"])
                break
    return total


def proxy_stats_from_rollout(rollout: JsonObject) -> ProxyStats:
    """:class:`ProxyStats` from the body of the proxy's ``GET /sessions/{id}/rollout``."""
    session = rollout.get("session") or {}
    calls = [c for c in rollout.get("calls") or [] if isinstance(c, dict)]
    return ProxyStats(
        model_calls=int(session.get("model_calls", len(calls))),
        tool_calls=count_tool_calls(calls),
        budget_stops=int(session.get("budget_stops", 0)),
        context_stops=int(session.get("context_stops", 0)),
    )
