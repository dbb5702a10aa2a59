"""Plumbing against the real embedded engine, started through the launcher (one start per module)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fineenvs.engine import EngineHandle, Grade, attach, launch_transformers_engine, probe_engine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineHandle]:
    with launch_transformers_engine(
        "tiny_qwen", log_dir=tmp_path_factory.mktemp("run"), timeout_s=300
    ) as handle:
        yield handle
    assert handle.pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(handle.pid, 0)  # stopped (and reaped) on exit


def greedy(engine: EngineHandle) -> dict:  # type: ignore[type-arg]
    body = {
        "model": engine.served_model_name,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 12,
        "temperature": 0.0,
        "return_token_ids": True,
    }
    response = httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_attach_learns_the_served_name(engine: EngineHandle) -> None:
    with attach(engine.url + "/v1") as attached:
        assert attached.url == engine.url and attached.kind == "attached"
    assert attached.served_model_name == engine.served_model_name == "tiny_qwen"
    with pytest.raises(ValueError, match="is not served by"):
        attach(engine.url, "LiquidAI/LFM2.5-2.6B")


def test_embedded_engine_is_graded_tokens(engine: EngineHandle) -> None:
    report = probe_engine(engine.url, engine.served_model_name)
    assert report.grade is Grade.tokens, report.summary()
    assert report.logprobs_mode == "processed" and report.logprobs_paired
    assert report.gap_t2 == pytest.approx(report.gap_t1 / 2, rel=1e-3)  # type: ignore[operator]


def test_weight_push_advances_the_version_and_changes_generations(engine: EngineHandle) -> None:
    import torch
    from safetensors.torch import load_file

    from fineenvs_recipes.tiny import ensure_tiny_model

    before = greedy(engine)
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(ensure_tiny_model("tiny_qwen").glob("*.safetensors")):
        weights.update(load_file(str(shard)))
    generator = torch.Generator().manual_seed(1)
    perturbed = {
        name: t + 0.5 * torch.randn(t.shape, generator=generator, dtype=t.dtype)
        if t.is_floating_point()
        else t
        for name, t in weights.items()
    }
    assert engine.weight_sync is not None
    start = int(httpx.get(engine.url + "/weight_info").json()["weight_version"])
    assert engine.weight_sync.push(perturbed, start + 1) == start + 1
    assert int(httpx.get(engine.url + "/weight_info").json()["weight_version"]) == start + 1
    after = greedy(engine)
    assert after["weight_version"] == start + 1 and before["weight_version"] == start
    assert after["choices"][0]["token_ids"] != before["choices"][0]["token_ids"]
    staged = Path(engine.weight_sync._staged.staging_dir)  # type: ignore[attr-defined]
    assert [p.name for p in staged.iterdir()] == [f"v{start + 1:06d}"]


def test_probe_cli(engine: EngineHandle) -> None:
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "fineenvs.engine.probe", engine.url, "--json"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["grade"] == "tokens" and report["model"] == "tiny_qwen"
