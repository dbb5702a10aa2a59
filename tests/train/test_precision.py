"""``trainer.dtype=bfloat16`` keeps the updates: float32 master weights under bf16 autocast.

At the published learning rate (3e-6) AdamW moves each weight by about ``lr``; bf16 keeps 8
significant bits, so bf16 weights above ~256 x lr in magnitude round every such step away. These
tests take one real optimizer step at lr 3e-6 and count the weights that moved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fineenvs.paths import REPO_ROOT
from fineenvs.train.grpo import CapturedGRPOTrainer
from tests.train.cpu_settings import cpu_settings

from .conftest import SampleRows

LR = 3e-6


def changed_after_one_step(trainer: CapturedGRPOTrainer, rows: list) -> tuple[int, int, dict[str, float]]:
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    metrics = trainer.step(rows)
    changed = total = 0
    for n, p in trainer.model.named_parameters():
        changed += int((p.detach() != before[n]).sum())
        total += p.numel()
    return changed, total, metrics


def test_bf16_step_at_published_lr_changes_as_many_weights_as_float32(
    tiny_qwen_dir: Path, sampled_rows: SampleRows, tmp_path: Path
) -> None:
    rows = sampled_rows(tiny_qwen_dir, attempts=4, seed=5)
    counts = {}
    for dtype in ("float32", "bfloat16"):
        trainer = CapturedGRPOTrainer(
            tiny_qwen_dir,
            cpu_settings(learning_rate=LR, dtype=dtype, per_device_batch_size=4),
            tmp_path / dtype,
        )
        assert all(p.dtype == torch.float32 for p in trainer.model.parameters()), "master weights are fp32"
        changed, total, metrics = changed_after_one_step(trainer, rows)
        counts[dtype] = changed
        assert changed > 0.5 * total, f"{dtype}: only {changed}/{total} weights moved"
        # On-policy rows from a float32 engine: bf16 compute moves the ratio by bf16 noise only.
        assert abs(metrics["train/ratio"] - 1.0) < (1e-4 if dtype == "float32" else 5e-2)
    # AdamW's first step moves every weight with a non-zero gradient by ~lr, in both precisions.
    assert counts["bfloat16"] >= 0.99 * counts["float32"], counts


def test_bf16_forward_really_runs_in_bf16(
    tiny_qwen_dir: Path, sampled_rows: SampleRows, tmp_path: Path
) -> None:
    rows = sampled_rows(tiny_qwen_dir, attempts=2, seed=6)
    logps = {}
    for dtype in ("float32", "bfloat16"):
        trainer = CapturedGRPOTrainer(tiny_qwen_dir, cpu_settings(dtype=dtype), tmp_path / dtype)
        logps[dtype] = torch.tensor(trainer.token_logprobs(rows[:1])[0])
    gap = float((logps["float32"] - logps["bfloat16"]).abs().max())
    assert 1e-5 < gap < 0.5, f"bf16 autocast should shift logprobs by rounding noise, got {gap}"


def test_plain_bf16_weights_would_lose_the_step(tiny_qwen_dir: Path) -> None:
    """The failure the float32 master copy prevents: the same AdamW step applied to bf16 weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen_dir, dtype=torch.bfloat16)
    params = [p for p in model.parameters() if p.numel() > 1000]
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.randn_like(p)
    torch.optim.AdamW(params, lr=LR, weight_decay=0.0).step()
    changed = sum(int((p.detach() != b).sum()) for p, b in zip(params, before, strict=True))
    total = sum(p.numel() for p in params)
    assert changed < 0.5 * total, f"bf16 weights kept {changed}/{total} updates; the premise no longer holds"


def test_float16_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_settings(dtype="float16").check()


@pytest.mark.slow
def test_the_prepared_gpu_check_runs_on_cpu(tmp_path: Path) -> None:
    """``scripts/gpu-check.sh`` runs ``benchmarks gpu``; its CPU mode keeps it from rotting."""
    import json
    import subprocess
    import sys

    out = tmp_path / "gpu.json"
    cmd = [sys.executable, "-m", "benchmarks", "gpu", "--device", "cpu", "--quick", "--dtype", "bfloat16"]
    done = subprocess.run(
        [*cmd, "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=REPO_ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert [f["model"] for f in figures] == ["tiny_qwen", "tiny_lfm2", "tiny_qwen3_5"]
    for f in figures:
        assert f["dtype"] == "bfloat16" and f["step_s_median"] > 0 and f["tokens_per_s"] > 0
        assert f["peak_memory_gb"] > 0 and abs(f["train_ratio_step0"] - 1.0) < 5e-2  # bf16 vs bf16 noise


@pytest.mark.parametrize("model", ["tiny_qwen", "tiny_lfm2", "tiny_qwen3_5"])
def test_vllm_pushes_name_tensors_as_the_checkpoint_files_do(
    model: str, tiny_model_factory: Any, tmp_path: Path
) -> None:
    """vLLM loads pushed tensors by checkpoint name and only warns about unknown names."""
    from safetensors import safe_open

    model_dir = tiny_model_factory(model)
    trainer = CapturedGRPOTrainer(model_dir, cpu_settings(), tmp_path)
    with safe_open(str(model_dir / "model.safetensors"), "pt") as files:
        names = set(files.keys())
    pushed = trainer.state_dict("bfloat16", checkpoint_format=True)
    assert set(pushed) == names
    assert {t.dtype for t in pushed.values()} == {torch.bfloat16}
