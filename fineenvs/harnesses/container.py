"""The container sandbox (``scheduler.sandbox=docker``): each attempt in its own Docker container.

What the container gets:

* its image: the task's own when the task brings an environment (a Harbor task's
  ``environment/Dockerfile``, built once and tagged by a hash of that folder's content), else
  ``scheduler.docker.image``, else the default image built here from this machine's runtime
  (:func:`default_image`: a shell, coreutils and every shared library the pinned agents and the
  host's Python link to, copied from the host; tagged by a hash of those files, so a second run
  reuses it);
* the pinned agent CLIs, read-only, at the same paths as on the host: the harness cache (agents,
  their venvs, the pinned Node) and the Python those venvs link to. Nothing is installed per attempt;
* HOME at ``/tmp/home`` and the working directory at ``/tmp/work`` (bind mounts of the attempt's
  folders; the same fixed paths as in the bwrap sandbox, so a harness's attempts share their prompt
  prefix), a fixed hostname, a read-only root and a private ``/tmp``;
* no network (``--network none``): the proxy is its one reachable service, through the Unix-socket
  bridge of the bwrap sandbox (``netbridge.py``, run by the mounted host Python inside the container,
  listening on the proxy's port on the container's loopback). The host's ports, its network and the
  user's environment are not there; the agent's environment is only what its harness lists;
* memory (swap included), pids and CPU limits from ``scheduler.docker``; a container killed for
  memory is the attempt's failure, recorded as such;
* the labels ``fineenvs.run=<run id>`` (a hash of the run's output folder) and
  ``fineenvs.attempt=<attempt id>``: the attempt removes its container when it ends, the attempt's
  guard removes it when the run is stopped or killed, and a restart on the same output folder
  removes whatever is still labelled with that run (:func:`remove_run_containers`), nothing else.

A task image must hold a glibc compatible with the host's (the mounted Python and agents link to
it); a Debian or Ubuntu image does. The default image and images built ``FROM`` it always do: a
task Dockerfile may write ``ARG FINEENVS_BASE_IMAGE`` / ``FROM ${FINEENVS_BASE_IMAGE}``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from fineenvs.harnesses.guard import ATTEMPT_LABEL, RUN_MARKER_ENV

RUN_LABEL = "fineenvs.run"
BRIDGE_IN_CONTAINER = "/opt/fineenvs/netbridge.py"
HOSTNAME = "fineenvs"
BASE_REPO = "fineenvs-base"
TASK_REPO = "fineenvs-task"
BUILD_TIMEOUT_S = 900.0
_MEMORY = re.compile(r"^[0-9]+[bkmg]?$")

# What the default image holds besides the shared libraries: what agents run in their shells.
BASE_PROGRAMS = (
    "sh bash dash env ls cat echo head tail grep egrep sed awk mawk find xargs wc sort uniq cut tr "
    "mkdir rmdir rm cp mv touch chmod ln pwd dirname basename date sleep test true false tee diff "
    "cmp which readlink realpath stat du df tar gzip gunzip printf id uname nproc seq od md5sum "
    "sha256sum expr mktemp"
).split()


@dataclass
class DockerSettings:
    """``scheduler.docker``: the container sandbox (docs/concepts/isolation.md)."""

    image: str = ""
    """Image for tasks without their own environment. Empty: the default image built on this
    machine from its runtime. A name (``registry.example.com/team/fineenvs-base:1``): used as it is,
    pulled by the daemon if it is not present (``docker login`` first for a private registry)."""
    task_images: dict[str, str] | None = None
    """Prebuilt images by task id (from a registry), used instead of building the task's Dockerfile."""
    build_task_images: bool = True
    """Build a task's ``environment/Dockerfile`` into its image (once per content). False: tasks
    run in ``image`` (or the default image) even when they bring a Dockerfile, e.g. one that starts
    FROM a registry image this machine cannot pull."""
    memory: str = "4g"
    """Memory limit per container (docker's ``-m``: bytes or with a b/k/m/g suffix); swap is not added."""
    pids: int = 512
    """Process limit per container (``--pids-limit``)."""
    cpus: float = 1.0
    """CPU limit per container (``--cpus``)."""

    def problems(self) -> list[str]:
        """What is wrong with these settings (``fineenvs.config.validate`` reports it at compose time)."""
        out: list[str] = []
        if not _MEMORY.match(str(self.memory).lower()):
            out.append(
                f"scheduler.docker.memory={self.memory!r} is not a size docker understands: a number "
                "with an optional b/k/m/g suffix. Fix: e.g. scheduler.docker.memory=4g"
            )
        if self.pids < 16:
            out.append(
                f"scheduler.docker.pids={self.pids} leaves an agent no room for its shells (at least 16). "
                "Fix: e.g. scheduler.docker.pids=512"
            )
        if self.cpus <= 0:
            out.append(f"scheduler.docker.cpus={self.cpus} must be > 0. Fix: e.g. scheduler.docker.cpus=1")
        return out


class DockerUnavailable(RuntimeError):
    """No docker client, or no daemon answering it."""


def docker_binary() -> str:
    found = shutil.which("docker")
    if found is None:
        raise DockerUnavailable(
            "scheduler.sandbox=docker needs the docker client, which is not on PATH: "
            "apt-get install docker.io (or scheduler.sandbox=bwrap / plain)."
        )
    return found


def daemon_problem() -> str | None:
    """Why containers cannot start here (None when the daemon answers)."""
    try:
        docker = docker_binary()
    except DockerUnavailable as exc:
        return str(exc)
    try:
        done = subprocess.run(
            [docker, "version", "--format", "{{.Server.Version}}"], capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        return (
            "scheduler.sandbox=docker needs a Docker daemon, and the one docker reaches did not answer "
            "within 30 s. Fix: check dockerd (its log), or point DOCKER_HOST at another."
        )
    if done.returncode != 0:
        return (
            "scheduler.sandbox=docker needs a Docker daemon, and none answers "
            f"({done.stderr.strip().splitlines()[-1] if done.stderr.strip() else 'no reply'}). "
            "Fix: start dockerd (e.g. `dockerd &`) or point DOCKER_HOST at one."
        )
    return None


_DAEMON_ANSWERED = False


def node_problem(settings: DockerSettings) -> str | None:
    """Why attempts cannot run in containers on this machine (None when they can): the check an
    attempt makes where it runs. With ``scheduler.backend=ray`` that is a rollout node, not the
    driver, which needs no daemon of its own. The daemon is asked until it has answered once in
    this process; one that dies later fails ``docker run``, which is then classified the same way."""
    global _DAEMON_ANSWERED
    if not _DAEMON_ANSWERED:
        problem = daemon_problem()
        if problem:
            return problem
        _DAEMON_ANSWERED = True
    return runtime_problem(settings)


def _docker(*args: str, timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([docker_binary(), *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise RuntimeError(
            f"docker {' '.join(args[:3])} failed ({done.returncode}): {done.stderr.strip()[-2000:]}"
        )
    return done


def image_exists(name: str) -> bool:
    return _docker("image", "inspect", name, check=False).returncode == 0


# ---- run identity and teardown -------------------------------------------------------------------

_PROCESS_RUN_ID = hashlib.sha256(f"{os.getpid()}-{os.urandom(8).hex()}".encode()).hexdigest()[:16]


def run_id(run_dir: str | None = None) -> str:
    """The label value of this run: a hash of its output folder (a restart on the same folder has the
    same id), or of this process where no run is marked (tests, benchmarks)."""
    value = run_dir if run_dir is not None else os.environ.get(RUN_MARKER_ENV)
    if not value:
        return _PROCESS_RUN_ID
    return hashlib.sha256(str(Path(value).resolve()).encode()).hexdigest()[:16]


def run_containers(rid: str) -> list[str]:
    """Ids of the containers (running or not) labelled with run ``rid``."""
    done = _docker("ps", "-aq", "--no-trunc", "--filter", f"label={RUN_LABEL}={rid}", check=False)
    return done.stdout.split() if done.returncode == 0 else []


def remove_run_containers(rid: str) -> list[str]:
    """Remove every container labelled with run ``rid`` (and only those); returns their ids."""
    ids = run_containers(rid)
    if ids:
        _docker("rm", "-f", *ids, check=False, timeout=120)
    return ids


# ---- images --------------------------------------------------------------------------------------


def _elf_deps(path: Path) -> set[str]:
    """Shared libraries ``path`` loads (``ldd``), the loader included; empty for non-ELF files."""
    done = subprocess.run(["ldd", str(path)], capture_output=True, text=True, timeout=30)
    deps: set[str] = set()
    for line in done.stdout.splitlines():
        parts = line.split()
        if "=>" in parts:
            target = parts[parts.index("=>") + 1]
            if target.startswith("/"):
                deps.add(target)
        elif parts and parts[0].startswith("/"):
            deps.add(parts[0])
    return deps


def _is_elf(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def _runtime_elves() -> list[Path]:
    """ELF files the mounted runtimes run: the host Python (and its extension modules) and every
    executable or shared object in the harness cache."""
    from fineenvs.paths import harness_cache

    found: list[Path] = []
    for root in (*python_prefixes(), harness_cache()):
        for folder, _dirs, files in os.walk(root):
            for name in files:
                path = Path(folder, name)
                if path.is_symlink() or not (
                    name.endswith((".so", ".node")) or ".so." in name or os.access(path, os.X_OK)
                ):
                    continue
                if _is_elf(path):
                    found.append(path)
    return found


SYSTEM_FOLDERS = frozenset(Path(p) for p in ("/", "/usr", "/usr/local"))
"""Where a mounted Python installation would hide the task image's own files."""


def runtime_problem(settings: DockerSettings) -> str | None:
    """Why task images cannot keep their own files here: the agents' Python installation, mounted
    into every container at its host path, is a system folder (a Debian system Python is ``/usr``)."""
    if not (settings.build_task_images or settings.task_images):
        return None
    shared = [str(p) for p in python_prefixes() if p in SYSTEM_FOLDERS]
    if not shared:
        return None
    return (
        f"scheduler.sandbox=docker mounts the agents' Python installation ({', '.join(shared)}) read-only at "
        "its host path in every container, which would hide the task image's own files there: task "
        "environments would silently run on this machine's. Fix: install the agents with a Python outside "
        "the system folders (pyenv, or `uv python install`), or run every attempt in the default image "
        "(scheduler.docker.build_task_images=false and no scheduler.docker.task_images)."
    )


def python_prefixes() -> list[Path]:
    """The Python installations the agents' venvs (and the bridge) run on: this interpreter's base
    and every ``home`` a venv in the harness cache names."""
    from fineenvs.paths import harness_cache

    prefixes = {Path(sys.base_prefix).resolve()}
    for cfg in harness_cache().glob("*/*/pyvenv.cfg"):
        for line in cfg.read_text(errors="replace").splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "home" and value.strip():
                prefixes.add(Path(value.strip()).resolve().parent)
    return sorted(prefixes)


def _base_files() -> dict[str, Path]:
    """Image path -> host file: the base programs and the closure of shared libraries they and the
    mounted runtimes need. Directories are resolved (``/lib`` is ``/usr/lib`` in the image too)."""
    wanted: list[Path] = []
    for prog in BASE_PROGRAMS:
        found = shutil.which(prog, path="/usr/bin:/bin:/usr/sbin")
        if found:
            wanted.append(Path(found))
    files: dict[str, Path] = {}
    libs: set[str] = set()
    for path in wanted:
        dest = str(Path(os.path.realpath(path.parent)) / path.name)
        files[dest] = path
        libs |= _elf_deps(path)
    for path in _runtime_elves():
        libs |= _elf_deps(path)
    from fineenvs.paths import harness_cache

    # Public data agents' runtimes read: the CA bundle (Node agents load trust roots even for a
    # plain-http proxy; Copilot refuses to start without them) and the C.UTF-8 locale agents' shells
    # set (without it bash warns into every tool result the model reads).
    for data in (
        Path("/etc/ssl/certs/ca-certificates.crt"),
        *sorted(Path("/usr/lib/locale/C.utf8").rglob("*")),
    ):
        if data.is_file():
            files[str(data)] = data
    mounted = [*python_prefixes(), harness_cache().resolve()]
    for lib in libs:
        p = Path(lib)
        real_dir = Path(os.path.realpath(p.parent))
        if not any(real_dir.is_relative_to(m) for m in mounted):  # those come with their mount
            files[str(real_dir / p.name)] = p
    return files


_ETC = {
    "etc/passwd": "root:x:0:0:root:/tmp/home:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/sh\n",
    "etc/group": "root:x:0:\nnogroup:x:65534:\n",
    "etc/nsswitch.conf": "passwd: files\ngroup: files\nhosts: files\n",
    "etc/hosts": "127.0.0.1 localhost\n::1 localhost\n",
    "etc/resolv.conf": "",
}
_BASE_RECIPE = "3"  # bump when the layout below changes


def _assemble_base(files: dict[str, Path], root: Path) -> None:
    root.mkdir(parents=True)
    for name in ("bin", "lib", "lib64", "sbin"):
        target = Path("/", name)
        if target.is_symlink():  # merged /usr: keep the host's layout
            (root / name).symlink_to(os.readlink(target))
    for rel in ("usr/bin", "usr/lib", "tmp", "opt/fineenvs", "proc", "dev", "sys", "etc"):
        (root / rel).mkdir(parents=True, exist_ok=True)
    (root / "tmp").chmod(0o1777)
    for rel, text in _ETC.items():
        (root / rel).write_text(text)
    for dest, src in files.items():
        out = root / dest.lstrip("/")
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, out)  # follows links: the library's content under the name ldd used
    usr_bin = root / "usr/bin"
    if not (usr_bin / "sh").exists() and (usr_bin / "dash").exists():
        (usr_bin / "sh").symlink_to("dash")
    # Agents run ``python3`` in their shells (data tasks): the mounted host Python, with its packages.
    local_bin = root / "usr/local/bin"
    local_bin.mkdir(parents=True, exist_ok=True)
    python = Path(sys.base_prefix).resolve() / "bin" / "python3"
    for name in ("python3", "python"):
        (local_bin / name).symlink_to(python)


_BUILD_LOCK = threading.Lock()
_BUILT: dict[str, str] = {}


def _stat_key(path: Path) -> str:
    try:
        st = path.stat()
    except OSError:
        return f"{path}:-"
    return f"{path}:{st.st_mtime_ns}:{st.st_size}"


def _runtime_key() -> str:
    """A cheap fingerprint of what the default image is made from (milliseconds, no ``ldd``): the
    recipe, the host Python (its executable's path, mtime and size), each install folder of the
    harness cache with its install marker (an agent or Node added or reinstalled), the base programs,
    and ``/etc/ld.so.cache`` (rewritten by ldconfig whenever the system's libraries change)."""
    from fineenvs.paths import MARKER_FILE, harness_cache

    parts = [_BASE_RECIPE, _runtime_name(), _stat_key(Path(sys.executable).resolve())]
    parts += [_stat_key(p.resolve()) for p in python_prefixes()]
    for entry in sorted(harness_cache().iterdir()):
        if entry.is_dir():
            parts.append(_stat_key(entry / MARKER_FILE))
    for prog in BASE_PROGRAMS:
        found = shutil.which(prog, path="/usr/bin:/bin:/usr/sbin")
        if found:
            parts.append(_stat_key(Path(found)))
    parts.append(_stat_key(Path("/etc/ld.so.cache")))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _base_tag_cache() -> Path:
    from fineenvs.paths import cache_dir

    return cache_dir() / "docker" / "default-image.json"


def _runtime_name() -> str:
    """Which runtime a default image belongs to: several Pythons (venvs of other checkouts) may
    share one harness cache and one daemon, each with its own current image."""
    return str(Path(sys.base_prefix).resolve())


def _read_base_tags() -> dict[str, dict[str, str]]:
    """runtime -> {"key": fingerprint, "tag": image} of each runtime's current default image."""
    try:
        known = json.loads(_base_tag_cache().read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in known.items() if isinstance(v, dict)} if isinstance(known, dict) else {}


def _cached_base_tag(key: str) -> str | None:
    """The tag built for this runtime fingerprint earlier (any process), if the daemon still has it."""
    entry = _read_base_tags().get(_runtime_name(), {})
    tag = entry.get("tag") if entry.get("key") == key else None
    return tag if isinstance(tag, str) and image_exists(tag) else None


def _remember_base_tag(key: str, tag: str) -> None:
    import fcntl

    path = _base_tag_cache()
    path.parent.mkdir(parents=True, exist_ok=True)
    with (path.parent / ".default-image.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # runs on other runtimes update their own entries
        known = _read_base_tags()
        known[_runtime_name()] = {"key": key, "tag": tag}
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(known, indent=1))
        tmp.replace(path)  # atomic: a reader sees the old file or the new one, never half


def default_image() -> str:
    """The default image, built from this machine's runtime once per content (``fineenvs-base:<hash>``).

    The content hash needs an ``ldd`` walk over every ELF file of the mounted runtimes (seconds);
    a cheap fingerprint of those runtimes (:func:`_runtime_key`) remembers its result across
    processes, so the walk runs only when the runtime changed or the image is gone."""
    with _BUILD_LOCK:
        if "base" in _BUILT:
            return _BUILT["base"]
        key = _runtime_key()
        tag = _cached_base_tag(key)
        if tag is None:
            tag, built = _build_default_image()
            _remember_base_tag(key, tag)
            if built:  # after remembering: the new tag is current, the runtime's previous one is not
                prune_base_images(keep={tag, *(e.get("tag", "") for e in _read_base_tags().values())})
        _BUILT["base"] = tag
        return tag


def _build_default_image() -> tuple[str, bool]:
    """Hash the runtime's files and build ``fineenvs-base:<hash>`` unless the daemon has it:
    (the tag, whether it was built now)."""
    files = _base_files()
    digest = hashlib.sha256(f"{_BASE_RECIPE}\0{_runtime_name()}".encode())
    for dest in sorted(files):
        digest.update(dest.encode() + b"\0")
        digest.update(hashlib.sha256(files[dest].read_bytes()).digest())
    tag = f"{BASE_REPO}:{digest.hexdigest()[:16]}"
    if image_exists(tag):
        return tag, False
    with tempfile.TemporaryDirectory(prefix="fineenvs-base-") as tmp:
        _assemble_base(files, Path(tmp) / "rootfs")
        (Path(tmp) / "Dockerfile").write_text(
            'FROM scratch\nCOPY rootfs/ /\nENV PATH=/usr/local/bin:/usr/bin:/bin\nCMD ["/bin/sh"]\n'
        )
        _build(tag, Path(tmp), label="the default image")
    return tag, True


def prune_base_images(*, keep: set[str], repo: str = BASE_REPO) -> list[str]:
    """Untag every ``fineenvs-base`` image that no container (running or stopped) uses, except
    ``keep`` (the current image of every runtime in the cache); returns the tags removed. Each
    runtime change builds a new default image (30-40 MB), and nothing else removes the old ones.
    An image a task image was built FROM only loses its tag; its layers stay while that needs them."""
    listed = _docker("images", repo, "--format", "{{.Repository}}:{{.Tag}} {{.ID}}", check=False)
    if listed.returncode != 0:
        return []
    used = _docker("ps", "-a", "--format", "{{.Image}}", check=False)
    if used.returncode != 0:  # cannot tell what is in use: remove nothing
        return []
    in_use = set(used.stdout.split())
    removed: list[str] = []
    for line in listed.stdout.splitlines():
        tag, _, image_id = line.partition(" ")
        if tag in keep or not tag.startswith(f"{repo}:") or tag.endswith(":<none>"):
            continue
        if tag in in_use or image_id in in_use:
            continue
        # Not -f: the daemon refuses an image a container created since the listing uses.
        if _docker("rmi", tag, check=False).returncode == 0:
            removed.append(tag)
    return removed


def _build(tag: str, context: Path, *, label: str, build_args: dict[str, str] | None = None) -> None:
    # --force-rm: a failed RUN step leaves no stopped container behind
    args = ["build", "-q", "--force-rm", "-t", tag, "--label", "fineenvs.image=1"]
    for key, value in (build_args or {}).items():
        args += ["--build-arg", f"{key}={value}"]
    done = _docker(*args, str(context), timeout=BUILD_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"building {label} ({tag}) from {context} failed: {done.stderr.strip()[-1500:]}. "
            "Images are built locally (no registry is needed): a Dockerfile must start FROM an image "
            "this daemon has, e.g. `ARG FINEENVS_BASE_IMAGE` + `FROM ${FINEENVS_BASE_IMAGE}`, or set "
            "scheduler.docker.task_images / scheduler.docker.image to a prebuilt image."
        )


_TASK_FAILED: dict[str, str] = {}


def task_image(environment: Path) -> str:
    """The image of a task's environment folder (``Dockerfile`` inside), built once per content."""
    digest = hashlib.sha256(b"task-env-1")
    for path in sorted(p for p in environment.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(environment)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    tag = f"{TASK_REPO}:{digest.hexdigest()[:16]}"
    with _BUILD_LOCK:
        if tag in _TASK_FAILED:  # one failing build per content, not one per attempt
            raise RuntimeError(_TASK_FAILED[tag])
        if tag in _BUILT or image_exists(tag):
            _BUILT[tag] = tag
            return tag
    base = default_image()
    with _BUILD_LOCK:
        if tag in _BUILT:  # another attempt's thread built it meanwhile
            return tag
        if tag in _TASK_FAILED:
            raise RuntimeError(_TASK_FAILED[tag])
        try:
            _build(
                tag,
                environment,
                label=f"the task image of {environment}",
                build_args={"FINEENVS_BASE_IMAGE": base},
            )
        except RuntimeError as exc:
            _TASK_FAILED[tag] = str(exc)
            raise
        _BUILT[tag] = tag
    return tag


def image_for(settings: DockerSettings, *, task_id: str | None, environment: Path | None) -> str:
    """Which image an attempt runs in (see the module docstring)."""
    if task_id and settings.task_images and task_id in settings.task_images:
        return settings.task_images[task_id]
    if settings.build_task_images and environment is not None and (environment / "Dockerfile").is_file():
        return task_image(environment)
    return settings.image or default_image()


# ---- one attempt's command line ------------------------------------------------------------------


def docker_argv(
    argv: list[str],
    *,
    settings: DockerSettings,
    image: str,
    name: str,
    attempt_id: str,
    home: Path,
    workdir: Path,
    sock_dir: Path,
    sock_name: str,
    port: int,
    env_names: list[str],
    sandbox_home: Path,
    sandbox_work: Path,
    sandbox_bridge: Path,
) -> list[str]:
    """``docker run`` of ``argv`` behind the proxy bridge (values of ``env_names`` come from the
    docker client's own environment, so they never appear on a command line)."""
    from fineenvs.paths import harness_cache

    python = Path(sys.base_prefix).resolve()  # the bridge's interpreter: stdlib only, mounted below
    mounts: list[str] = []
    for path in (*python_prefixes(), harness_cache().resolve()):
        mounts += ["-v", f"{path}:{path}:ro"]
    # A harness that runs a driver script of ours (OpenHands) names it on its command line: that
    # file alone, never the rest of the package (the task code and graders stay out).
    here = Path(__file__).resolve().parent
    for arg in dict.fromkeys(argv):
        if arg.endswith(".py") and Path(arg).is_file() and Path(arg).resolve().parent == here:
            mounts += ["-v", f"{arg}:{arg}:ro"]
    bridge = Path(__file__).with_name("netbridge.py")
    return [
        docker_binary(), "run", "--name", name,
        "--label", f"{RUN_LABEL}={run_id()}", "--label", f"{ATTEMPT_LABEL}={attempt_id}",
        "--network", "none", "--hostname", HOSTNAME,
        "--read-only", "--tmpfs", "/tmp:rw,exec,mode=1777",
        "--memory", settings.memory, "--memory-swap", settings.memory,
        "--pids-limit", str(settings.pids), "--cpus", str(settings.cpus),
        "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
        "--user", f"{os.getuid()}:{os.getgid()}", "--init",
        "-v", f"{home}:{sandbox_home}", "-v", f"{workdir}:{sandbox_work}",
        "-v", f"{sock_dir}:{sandbox_bridge}", "-v", f"{bridge}:{BRIDGE_IN_CONTAINER}:ro",
        *mounts,
        "-w", str(sandbox_work),
        *[a for n in env_names for a in ("-e", n)],
        image,
        str(python / "bin" / "python3"), "-I", BRIDGE_IN_CONTAINER, str(port), str(sandbox_bridge / sock_name),
        "--", *argv,
    ]  # fmt: skip


@dataclass(frozen=True)
class ContainerEnd:
    """How an attempt's container ended: killed for memory, its exit code, whether its command
    ever started (False where docker itself failed first: no image, a bad mount, no such runtime),
    and docker's own error about it."""

    oom: bool
    code: int | None
    started: bool
    error: str


_NEVER = "0001-01-01T00:00:00Z"  # docker's StartedAt of a container whose process never ran


def container_end(name: str) -> ContainerEnd:
    """How the named container ended (see :class:`ContainerEnd`); then it is removed. A container
    that does not exist (``docker run`` failed before creating it) never started."""
    done = _docker("inspect", "--format", "{{json .State}}", name, check=False)
    end = ContainerEnd(False, None, False, "")
    if done.returncode == 0:
        state = json.loads(done.stdout)
        started = str(state.get("StartedAt") or _NEVER)
        end = ContainerEnd(
            oom=bool(state.get("OOMKilled")),
            code=state.get("ExitCode"),
            started=not started.startswith("0001-"),
            error=str(state.get("Error") or ""),
        )
    _docker("rm", "-f", name, check=False)
    return end


DOCKER_RUN_OWN_CODES = (125, 126, 127)
"""``docker run``'s exit codes for its own failures: 125 the daemon's error (no image, a bad
option or mount, no daemon), 126 the command cannot be invoked, 127 it cannot be found. An agent
can exit with these too, but only after its container started."""


def startup_failure(returncode: int | None, end: ContainerEnd, stderr: str) -> str | None:
    """docker's own error where ``docker run`` failed before the agent started (an infrastructure
    failure, not the agent's), else None."""
    if returncode not in DOCKER_RUN_OWN_CODES or end.started:
        return None
    said = [line.strip() for line in stderr.splitlines() if line.strip().startswith("docker:")]
    why = end.error or (said[-1] if said else "") or (stderr.strip().splitlines() or ["no message"])[-1]
    return f"the container did not start (docker run exited {returncode}): {why[-1500:]}"
