"""Real vLLM checks, for GPU machines (``pytest -m gpu tests/engine_plumbing``).

- ``--engine-url=http://host:port`` (option from tests/conftest.py): probe a running vLLM; it must
  be graded ``tokens`` (i.e. it was started with the published flags).
- Launch and sync: ``FINEENVS_VLLM_MODEL`` (a local HF checkpoint directory; default: tiny_agent,
  built offline) served by vLLM (``FINEENVS_VLLM_PYTHON`` = a vLLM venv's python, else
  ``vllm`` on PATH) with checkpoint-reload weight sync: probe grade, a weight push that changes
  greedy generations, and the weight version reported by ``/weight_info``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest

from fineenvs.engine import Grade, VLLMServeArgs, launch_vllm, probe_engine, require_training_grade
from fineenvs.engine.launcher import cuda_devices

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not cuda_devices()[0],
        reason="needs an NVIDIA GPU (vLLM's CUDA build; its CPU build is the vllm tier)",
    ),
]


def test_attached_vllm_is_graded_tokens(request: pytest.FixtureRequest) -> None:
    url = request.config.getoption("--engine-url")
    if not url:
        pytest.skip("pass --engine-url=http://host:port to probe a running vLLM")
    report = probe_engine(url, request.config.getoption("--engine-model"))
    require_training_grade(report)
    assert report.logprobs_mode == "processed"


def _greedy(url: str, model: str) -> list[int]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 8,
        "temperature": 0.0,
        "return_token_ids": True,
    }
    return list(
        httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["token_ids"]
    )


def test_launch_probe_and_reload_sync(tmp_path: Path) -> None:
    from fineenvs.engine.install import installed_python

    installed = installed_python("cuda")
    python = os.environ.get("FINEENVS_VLLM_PYTHON") or (str(installed) if installed else None)
    if python is None and shutil.which("vllm") is None:
        pytest.skip(
            "no vLLM: `python -m fineenvs.engine install-vllm`, or FINEENVS_VLLM_PYTHON=/path/to/vllm-venv/bin/python"
        )
    model = os.environ.get("FINEENVS_VLLM_MODEL")
    if model is None:
        from fineenvs_recipes.tiny import ensure_tiny_model

        model = str(ensure_tiny_model("tiny_agent"))  # heads of 32: every attention backend serves them
    args = VLLMServeArgs(
        model=model,
        served_model_name="probe-model",
        port=0,
        dtype="float32",
        max_model_len=2048,
        gpu_memory_utilization=0.3,
        tool_call_parser="hermes",
        default_chat_template_kwargs=None,
        weight_sync="reload",
        python=python,
    )
    with launch_vllm(args, tmp_path, timeout_s=900) as engine:
        report = probe_engine(engine.url, engine.served_model_name)
        assert report.grade is Grade.tokens, report.summary()
        before = _greedy(engine.url, engine.served_model_name)

        import torch
        from safetensors.torch import load_file

        weights = {}
        for shard in Path(model).glob("*.safetensors"):
            weights.update(load_file(str(shard)))
        torch.manual_seed(0)
        perturbed = {
            k: v + 0.5 * torch.randn_like(v) if v.is_floating_point() else v for k, v in weights.items()
        }
        assert engine.weight_sync is not None
        assert engine.weight_sync.push(perturbed, 1) == 1
        assert httpx.get(engine.url + "/weight_info").json()["weight_version"] == "1"
        assert _greedy(engine.url, engine.served_model_name) != before
