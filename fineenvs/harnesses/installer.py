"""Install pinned harness CLIs into the cache, one prefix (npm) or virtual environment (PyPI) each.

Layout: ``harness_cache()/<name>-<version>/`` holding ``node_modules/`` (npm) or ``venv/`` (PyPI)
and a marker file with the version. An install goes into a temporary sibling directory that is
renamed into place only when complete, under a per-harness file lock, so two processes installing
at once never see half a harness and a second caller waits and then finds it done.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Protocol

from fineenvs.harnesses.base import Harness
from fineenvs.harnesses.node import NODE, compile_cache_dir
from fineenvs.paths import MARKER_FILE, harness_cache

# Python agents must never pull a second torch into their venv (it is huge and conflicts).
PIP_CONSTRAINTS = "torch==2.13.0\n"


class InstallError(RuntimeError):
    """An install command failed; the message names the harness, the command and the log file."""


def find_python(version: str) -> str:
    """An interpreter of ``version`` ("3.12"): a pyenv install (this machine kind has them), else PATH.

    pyenv's shims are skipped: they answer only for the globally selected versions.
    """
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    for cand in sorted(root.glob(f"{version}.*"), reverse=True):
        exe = cand / "bin" / f"python{version}"
        if exe.exists():
            return str(exe)
    found = shutil.which(f"python{version}")
    if found and "/shims/" not in found:
        return found
    raise InstallError(
        f"no Python {version} interpreter found (looked in ~/.pyenv/versions and for python{version} on PATH); "
        f"install one, e.g. `pyenv install {version}`"
    )


def base_python(version: str | None = None) -> str:
    """The system interpreter, not this project's venv (a venv of a venv would inherit its paths)."""
    if version is not None:
        return find_python(version)
    base = getattr(sys, "_base_executable", None)
    if base and Path(base).exists():
        return str(base)
    found = shutil.which("python3")
    if not found:
        raise InstallError("no python3 on PATH to create harness virtual environments; install python3")
    return found


class Installable(Protocol):
    """What the installer needs of a thing it installs: an agent (Harness) or the pinned Node."""

    @property
    def name(self) -> str: ...
    @property
    def package(self) -> str: ...
    @property
    def registry(self) -> str: ...
    @property
    def version(self) -> str: ...
    @property
    def python_version(self) -> str | None: ...
    @property
    def install_dir(self) -> Path: ...
    @property
    def binary_path(self) -> Path: ...
    def install_requirements(self) -> list[str]: ...
    def post_install(self, prefix: Path) -> list[tuple[list[str], dict[str, str]]]: ...
    def installed_version(self) -> str | None: ...
    def is_installed(self) -> bool: ...
    def install_command_hint(self) -> str: ...


def log_path(h: Installable) -> Path:
    return harness_cache() / f"{h.name}-{h.version}.install.log"


def _run(cmd: list[str], *, log: Path, cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
    with log.open("a") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n")
        fh.flush()
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=cwd, env=env, check=False)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise InstallError(f"command failed (exit {proc.returncode}): {' '.join(cmd)}\nlog: {log}\n{tail}")


def _relocate_venv_scripts(venv: Path, old: Path, new: Path) -> None:
    """Console scripts carry their venv's absolute path in the shebang; point them at the final one."""
    old_b, new_b = str(old).encode(), str(new).encode()
    for path in (venv / "bin").iterdir():
        if path.is_symlink() or not path.is_file():
            continue
        data = path.read_bytes()
        if old_b in data[:100_000] and b"\0" not in data[:4096]:
            path.write_bytes(data.replace(old_b, new_b))
    cfg = venv / "pyvenv.cfg"
    if cfg.exists():
        cfg.write_bytes(cfg.read_bytes().replace(old_b, new_b))


def _install_into(h: Installable, tmp: Path, log: Path) -> None:
    reqs = h.install_requirements()
    if h.registry == "npm":
        npm = shutil.which("npm")
        if not npm:
            raise InstallError(f"{h.name} needs npm (and node >= 20): apt-get install nodejs npm")
        env = {**os.environ, "npm_config_update_notifier": "false"}
        _run(
            [npm, "install", "--prefix", str(tmp), "--no-audit", "--no-fund", "--loglevel=error", *reqs],
            log=log,
            env=env,
        )
        return
    venv = tmp / "venv"
    _run([base_python(h.python_version), "-m", "venv", str(venv)], log=log)
    constraints = tmp / "constraints.txt"
    constraints.write_text(PIP_CONSTRAINTS)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    _run([*pip, "install", "--disable-pip-version-check", "-c", str(constraints), *reqs], log=log)


def install(h: Harness, *, force: bool = False, echo: Callable[[str], None] = print) -> Path:
    """Install ``h`` at its pinned version (no-op when already installed); return its directory.

    An npm agent brings the pinned Node it runs on (installed once, shared) and has its compile
    cache warmed (fineenvs/harnesses/node.py), also when the agent itself was already installed.
    """
    if h.registry == "npm":
        _install(NODE, force=False, echo=echo)
    path = _install(h, force=force, echo=echo)
    if h.registry == "npm":
        warm_compile_cache(h, echo=echo)
    return path


def _lock(h: Installable) -> IO[str]:
    """The per-install lock file (held with flock while installing or warming)."""
    return (harness_cache() / f".{h.name}-{h.version}.lock").open("w")


def _install(h: Installable, *, force: bool, echo: Callable[[str], None]) -> Path:
    if h.is_installed() and not force:
        return h.install_dir
    cache = harness_cache()
    with _lock(h) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if h.is_installed() and not force:
            return h.install_dir
        log = log_path(h)
        log.write_text(f"install {h.name} {h.version} at {time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
        echo(f"installing {h.name} {h.version} ({h.registry}: {' '.join(h.install_requirements())}) ...")
        started = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{h.name}-{h.version}-", dir=cache))
        try:
            _install_into(h, tmp, log)
            for cmd, env in h.post_install(tmp):
                _run(cmd, log=log, env=env)
            if h.registry == "pypi":
                _relocate_venv_scripts(tmp / "venv", tmp, h.install_dir)
            (tmp / MARKER_FILE).write_text(
                json.dumps(
                    {
                        "name": h.name,
                        "package": h.package,
                        "version": h.version,
                        "requirements": h.install_requirements(),
                    }
                )
            )
            final = h.install_dir
            if final.exists():
                trash = Path(tempfile.mkdtemp(prefix=f".old-{h.name}-", dir=cache))
                final.rename(trash / "old")
                shutil.rmtree(trash, ignore_errors=True)
            tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if not h.binary_path.exists():
            raise InstallError(
                f"{h.name} {h.version} installed but its binary {h.binary_path} is missing; see {log}"
            )
        echo(f"installed {h.name} {h.version} in {time.monotonic() - started:.0f} s -> {h.install_dir}")
        return h.install_dir


def warm_compile_cache(h: Harness, *, echo: Callable[[str], None] = print) -> None:
    """Start the agent once (``h.warm_argv()``) so that Node fills its compile cache.

    Outside any sandbox, in a throwaway HOME, under the agent's install lock; once per agent and
    Node version (a stamp in the cache). A failing start only costs speed: it is logged, and the
    next install call tries again.
    """
    cache = compile_cache_dir(h.install_dir)
    stamp = cache / f".warmed-by-node-{NODE.version}"
    if stamp.exists() or not h.is_installed():
        return
    with _lock(h) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists():
            return
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="fineenvs-warm-") as tmp:
            home = Path(tmp)
            (home / "tmp").mkdir()
            argv = h.warm_argv()
            try:
                proc = subprocess.run(
                    argv, env=h.base_env(home), cwd=home, capture_output=True, timeout=120, check=False
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                echo(f"warning: warming {h.name}'s compile cache failed ({exc}); its starts stay slower")
                return
        with log_path(h).open("a") as fh:
            fh.write(f"\n$ {' '.join(argv)}  (compile-cache warm-up, exit {proc.returncode})\n")
        if proc.returncode != 0:
            echo(
                f"warning: warming {h.name}'s compile cache failed (exit {proc.returncode}: "
                f"{proc.stderr.decode(errors='replace')[-300:]}); its starts stay slower"
            )
            return
        stamp.write_text(f"{h.name} {h.version} warmed by node {NODE.version}\n")


def install_many(
    harnesses: Iterable[Harness], *, force: bool = False, jobs: int = 3
) -> dict[str, str | None]:
    """Install several harnesses in parallel; returns name -> error message (None when fine)."""
    items = list(harnesses)
    results: dict[str, str | None] = {}
    if any(h.registry == "npm" for h in items):
        # Once, before the agents that run on it: a failure is every npm agent's failure.
        try:
            _install(NODE, force=False, echo=print)
        except (InstallError, OSError, RuntimeError) as exc:
            results = {
                h.name: f"the pinned Node.js failed to install: {exc}" for h in items if h.registry == "npm"
            }
            items = [h for h in items if h.registry != "npm"]

    def one(h: Harness) -> tuple[str, str | None]:
        try:
            install(h, force=force)
        except (InstallError, OSError) as exc:
            return h.name, str(exc)
        return h.name, None

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for name, err in pool.map(one, items):
            results[name] = err
    return results


def problems(harnesses: Iterable[Harness]) -> list[str]:
    """Clear, actionable messages for every harness that is missing or at the wrong version (and
    for the pinned Node, when an npm agent needs it)."""
    items = list(harnesses)
    needs_node: list[Installable] = [NODE] if any(h.registry == "npm" for h in items) else []
    out: list[str] = []
    for h in [*needs_node, *items]:
        what = "Node.js, the npm agents' runtime," if h is NODE else f"harness {h.name}"
        reinstall = (
            f"rm -rf {h.install_dir} && {h.install_command_hint()}"
            if h is NODE
            else f"{h.install_command_hint()} --force"
        )
        found = h.installed_version()
        if found is None:
            try:
                package = h.package
            except RuntimeError as exc:  # no pinned Node binary for this platform
                out.append(str(exc))
                continue
            out.append(
                f"{what} ({package} {h.version}) is not installed in {h.install_dir}; "
                f"run: {h.install_command_hint()}"
            )
        elif found != h.version:
            out.append(
                f"{what} is installed at version {found} but {h.version} is pinned; "
                f"run: {h.install_command_hint()}"
            )
        elif isinstance(h, Harness) and h.installed_requirements() not in (None, h.install_requirements()):
            out.append(
                f"{what} {h.version} was installed from {h.installed_requirements()}, but its pinned "
                f"requirements are now {h.install_requirements()}; run: {h.install_command_hint()}"
            )
        elif not h.binary_path.exists():
            out.append(f"{what} {h.version} is incomplete ({h.binary_path} missing); run: {reinstall}")
    return out
