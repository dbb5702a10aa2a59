"""Every published RL recipe, scaled down to CPU (tiny model of the recipe's architecture family,
embedded engine, one demo task, one GRPO step), runs its real code path end to end: the recipe's
harness mix, reward, sampling policy and trainer settings, with only sizes overridden.
The SFT recipes run in tests/sft (teacher collection → SFT)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fineenvs.paths import REPO_ROOT

pytestmark = pytest.mark.slow

# recipe -> tiny model of the same architecture family (LFM2.5: short-conv hybrid; Qwen3.5: linear-attention hybrid)
RL_RECIPES = {
    "rl_multi": "tiny_lfm2",
    "rl_opencode": "tiny_lfm2",
    "qwen_rl_multi": "tiny_qwen3_5",
    "qwen_rl_opencode": "tiny_qwen3_5",
    "qwen_rl_opencode_standalone": "tiny_qwen3_5",
}

SCALE_DOWN = [
    "engine=transformers",
    "tasks=demo",
    "tasks.limit=1",
    "tasks.subset=null",
    "scheduler.group_size=2",
    "scheduler.max_inflight=2",
    "scheduler.max_model_calls=3",
    "scheduler.attempt_timeout_seconds=180",
    "scheduler.passes=1",
    "trainer.max_steps=1",
    "trainer.per_device_batch_size=1",
    "trainer.gradient_accumulation_steps=1",
    "trainer.save_steps=1",
    "trainer.eval_steps=100",
    "trainer.token_budget=16384",
    "trainer.dtype=float32",
    "trainer.gradient_checkpointing=false",
    "sampling.max_tokens=32",
    "logger=none",
]


@pytest.mark.parametrize("recipe", sorted(RL_RECIPES))
def test_rl_recipe_scaled_down(recipe: str, tmp_path: Path) -> None:
    out = tmp_path / recipe
    cmd = [
        sys.executable, "-m", "fineenvs.run", f"+experiment={recipe}", f"model={RL_RECIPES[recipe]}",
        *SCALE_DOWN, f"hydra.run.dir={out}",
    ]  # fmt: skip
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=1200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["rows_trained"] > 0
    assert abs(summary["last_ratio"] - 1.0) < 1e-3
    attempts = [json.loads(line) for line in (out / "attempts.jsonl").read_text().splitlines()]
    assert {a["harness"] for a in attempts} <= {"opencode", "claude_code", "codex", "mini_swe_agent"}
    assert all(a["model_calls"] >= 1 for a in attempts), "every attempt reached the model"
