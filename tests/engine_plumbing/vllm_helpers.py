"""Helpers for the vllm tier: vLLM's own environments (``python -m fineenvs.engine install-vllm``),
vLLM's ``vllm serve`` parser as a tool, and a real vLLM server of the CPU build.

A missing environment fails the tests with the command that builds it; nothing is skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from fineenvs.paths import REPO_ROOT

VLLM_ARGV = REPO_ROOT / "fineenvs" / "engine" / "vllm_argv.py"


def build_python(build: str) -> Path:
    """The python of vLLM's ``build`` environment (cpu: the serving CPU build; parser: vLLM 0.33.0)."""
    from fineenvs.engine.install import installed_python

    python = installed_python(build)
    if python is None:
        pytest.fail(
            f"the vllm tier needs vLLM's {build} environment: run `python -m fineenvs.engine install-vllm "
            f"--build {build}` (make test-vllm does)"
        )
    return python


def run_in_vllm_env(script: str, payload: Any = None, timeout: int = 300, build: str = "parser") -> Any:
    """Run ``script`` (Python source) with vLLM's python; it reads JSON on stdin and prints JSON."""
    done = subprocess.run(
        [str(build_python(build)), "-c", script],
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


def vllm_parse_many(
    argvs: list[list[str]], hub_cache: Path | None = None, build: str = "parser"
) -> list[dict[str, Any]]:
    """``vllm_argv.py parse-many`` with the ``build``'s vLLM: one import for many command lines,
    offline (the Hub is never reached), Hub ids resolved in ``hub_cache`` (``fake_hub_cache``)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if hub_cache is not None:
        env["HF_HUB_CACHE"] = str(hub_cache)
    done = subprocess.run(
        [str(build_python(build)), str(VLLM_ARGV), "parse-many"],
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


@contextmanager
def real_vllm(
    model_dir: Path,
    log_dir: Path,
    *,
    served_model_name: str = "tiny_agent",
    weight_sync: str | None = "file_transfer",
    dtype: str = "float32",
    prefix_caching: bool = True,
) -> Iterator[Any]:
    """vLLM's CPU build serving ``model_dir``, launched by fineenvs' own launcher (the weight
    routes on, the ``fineenvs_file`` transfer backend configured); yields the ``EngineHandle``."""
    from fineenvs.engine.handle import launch_vllm
    from fineenvs.engine.vllm import VLLMServeArgs

    args = VLLMServeArgs(
        model=str(model_dir), served_model_name=served_model_name, port=0, dtype=dtype, platform="cpu",
        max_model_len=4096, tool_call_parser="hermes", weight_sync=weight_sync,
        enable_prefix_caching=prefix_caching, python=str(build_python("cpu")), family_template=False,
    )  # fmt: skip
    with launch_vllm(args, log_dir, timeout_s=600) as engine:
        yield engine


def scorer(model_dir: Path) -> Callable[[list[list[int]]], list[list[float]]]:
    """A trainer's view of ``model_dir``: float32 logprobs at temperature 1 of every token after
    the first (what ``CapturedGRPOTrainer.sequence_logprobs`` computes)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def score(sequences: list[list[int]]) -> list[list[float]]:
        out = []
        with torch.no_grad():
            for seq in sequences:
                ids = torch.tensor([seq])
                logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
                out.append(logprobs.gather(-1, ids[0, 1:, None])[:, 0].tolist())
        return out

    return score
