"""Installer: marker-based idempotency, clear problems, atomic real installs (npm, tiny package)."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from fineenvs.api_formats import ApiFormat
from fineenvs.harnesses import HARNESSES
from fineenvs.harnesses import installer as inst
from fineenvs.harnesses.base import Harness, Launch
from fineenvs.harnesses.node import NODE
from fineenvs.paths import MARKER_FILE


class TinyNpm(Harness):
    """A real, tiny npm package with a bin, to exercise the installer without a 300 MB agent."""

    name = "tiny_semver"
    package = "semver"
    registry = "npm"
    version = "7.6.3"
    binary = "semver"
    api_formats = (ApiFormat.openai_chat,)
    default_format = ApiFormat.openai_chat

    def write_config(self, launch: Launch) -> None:
        pass

    def arguments(self, launch: Launch) -> list[str]:
        return []

    def warm_argv(self) -> list[str]:
        return [str(self.binary_path), "1.2.3"]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FINEENVS_CACHE", str(tmp_path))
    return tmp_path / "harnesses"


def _fake_node() -> None:
    """The pinned Node, as far as the installer can tell (marker and binary)."""
    NODE.install_dir.mkdir(parents=True)
    (NODE.install_dir / MARKER_FILE).write_text(json.dumps({"version": NODE.version}))
    NODE.bin_dir.mkdir(parents=True)
    NODE.binary_path.write_text("#!/bin/sh\n")


def _fake_install(h: Harness, version: str, *, with_binary: bool = True) -> None:
    h.install_dir.mkdir(parents=True)
    (h.install_dir / MARKER_FILE).write_text(json.dumps({"version": version}))
    if with_binary:
        h.bin_dir.mkdir(parents=True)
        h.binary_path.write_text("#!/bin/sh\n")


def test_problems_missing_wrong_version_incomplete(cache: Path) -> None:
    h = TinyNpm()
    no_node, missing = inst.problems([h])
    assert "Node.js, the npm agents' runtime," in no_node and f"node-{NODE.version}" in no_node
    _fake_node()
    (missing,) = inst.problems([h])
    assert "not installed" in missing and "python -m fineenvs.harnesses install tiny_semver" in missing
    _fake_install(h, "7.0.0")
    (wrong,) = inst.problems([h])
    assert "installed at version 7.0.0 but 7.6.3 is pinned" in wrong
    (h.install_dir / MARKER_FILE).write_text(json.dumps({"version": "7.6.3"}))
    assert inst.problems([h]) == []
    h.binary_path.unlink()
    (incomplete,) = inst.problems([h])
    assert "incomplete" in incomplete and "--force" in incomplete


def test_a_changed_requirement_means_a_reinstall(cache: Path) -> None:
    h = TinyNpm()
    _fake_node()
    _fake_install(h, h.version)
    assert h.is_installed()
    marker = {"version": h.version, "requirements": ["semver@7.6.3", "node@22.23.3"]}
    (h.install_dir / MARKER_FILE).write_text(json.dumps(marker))
    assert not h.is_installed()
    (stale,) = inst.problems([h])
    assert "node@22.23.3" in stale and "python -m fineenvs.harnesses install tiny_semver" in stale


def test_install_is_a_noop_when_marker_and_binary_present(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = TinyNpm()
    _fake_install(h, h.version)

    def boom(*args: object, **kw: object) -> None:
        raise AssertionError("installer ran although the harness is installed")

    monkeypatch.setattr(inst, "_install_into", boom)
    _fake_node()
    started = time.monotonic()
    assert inst.install(h) == h.install_dir
    assert time.monotonic() - started < 0.5
    assert inst.problems([h]) == []


def test_failed_install_leaves_nothing_behind(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    h = TinyNpm()
    _fake_node()

    def fail(h: Harness, tmp: Path, log: Path) -> None:
        (tmp / "node_modules").mkdir()
        raise inst.InstallError("npm exploded")

    monkeypatch.setattr(inst, "_install_into", fail)
    with pytest.raises(inst.InstallError, match="npm exploded"):
        inst.install(h)
    assert not h.install_dir.exists()
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp-")]


class TinyNpmWithPostInstall(TinyNpm):
    """Writes a file into the prefix after install (as Copilot CLI unpacks its package there)."""

    fail = False

    def post_install(self, prefix: Path) -> list[tuple[list[str], dict[str, str]]]:
        script = "exit 3" if self.fail else f'echo unpacked > "{prefix}/unpacked.txt"'
        return [(["/bin/sh", "-c", script], {"PATH": "/usr/bin:/bin"})]


def _fake_npm(h: Harness, tmp: Path, log: Path) -> None:
    (tmp / "node_modules" / ".bin").mkdir(parents=True)
    (tmp / "node_modules" / ".bin" / h.binary).write_text("#!/bin/sh\n")


def test_post_install_runs_in_the_prefix_before_it_is_renamed(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = TinyNpmWithPostInstall()
    monkeypatch.setattr(inst, "_install_into", _fake_npm)
    _fake_node()
    inst.install(h, echo=lambda s: None)
    assert (h.install_dir / "unpacked.txt").read_text() == "unpacked\n"
    assert "$ /bin/sh -c" in inst.log_path(h).read_text()


def test_failed_post_install_fails_the_install_and_leaves_nothing(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = TinyNpmWithPostInstall()
    h.fail = True
    monkeypatch.setattr(inst, "_install_into", _fake_npm)
    _fake_node()
    with pytest.raises(inst.InstallError, match="exit 3"):
        inst.install(h, echo=lambda s: None)
    assert not h.install_dir.exists()
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp-")]


class TinyNpmWarmUp(TinyNpm):
    """Its start records the environment it ran in, and fails while ``fail`` is set."""

    fail = False

    def warm_argv(self) -> list[str]:
        code = "exit 5" if self.fail else 'echo "$PATH" >> "$NODE_COMPILE_CACHE/started"'
        return ["/bin/sh", "-c", code]


def test_the_compile_cache_is_warmed_once_with_the_agents_environment(cache: Path) -> None:
    h = TinyNpmWarmUp()
    _fake_node()
    _fake_install(h, h.version)
    h.fail = True
    said: list[str] = []
    inst.install(h, echo=said.append)
    assert "warming tiny_semver's compile cache failed (exit 5" in said[0]
    assert not list((h.install_dir / ".node-compile-cache").glob(".warmed-*"))
    h.fail = False
    inst.install(h, echo=said.append)
    inst.install(h, echo=said.append)  # warmed already: does not start the agent again
    (path,) = (h.install_dir / ".node-compile-cache" / "started").read_text().splitlines()
    assert str(NODE.bin_dir) in path.split(os.pathsep)
    assert "compile-cache warm-up, exit 0" in inst.log_path(h).read_text()


def test_every_pinned_version_is_exact() -> None:
    for h in HARNESSES.values():
        assert h.version and h.version[0].isdigit() and not any(c in h.version for c in "^~<>*x "), h.name
        for req in h.install_requirements():
            assert ("@" in req[1:]) if h.registry == "npm" else ("==" in req), req


@pytest.mark.slow
def test_real_npm_install_idempotent_and_parallel_safe(cache: Path) -> None:
    h = TinyNpm()
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(inst.install(h, echo=lambda s: None)))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [h.install_dir, h.install_dir]
    # One real install ran: the second caller waited on the lock and found it done; then one
    # warm-up start filled the compile cache.
    log = inst.log_path(h).read_text()
    assert log.count("$ ") == 2 and log.count("compile-cache warm-up, exit 0") == 1
    # The pinned Node came with it, from the npm registry, and the start compiled into the cache.
    version = subprocess.run([str(NODE.binary_path), "--version"], capture_output=True, text=True, check=True)
    assert version.stdout.strip() == f"v{NODE.version}"
    cached = [p for p in (h.install_dir / ".node-compile-cache").rglob("*") if p.is_file()]
    assert any(not p.name.startswith(".warmed") for p in cached), cached
    out = subprocess.run(
        [str(h.binary_path), "1.2.3", "-r", ">=1.0.0"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "1.2.3"
    assert json.loads((h.install_dir / MARKER_FILE).read_text())["version"] == "7.6.3"
    mtime = (h.install_dir / MARKER_FILE).stat().st_mtime
    started = time.monotonic()
    inst.install(h)
    assert time.monotonic() - started < 0.5
    assert (h.install_dir / MARKER_FILE).stat().st_mtime == mtime
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp-")]
