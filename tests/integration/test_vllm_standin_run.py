"""``engine=vllm`` end to end on CPU: the scaled-down ``rl_multi`` recipe launched through the real
launcher against the vLLM stand-in (``fineenvs.engine.standin``, named so everywhere: it is not
vLLM), with two real agent CLIs, three optimizer steps and a weight push after each.

What it shows: the serve command starts (template written where it names it), vLLM gets its own
GPU and the trainer the other (a fake ``nvidia-smi`` lists two), every push reaches the engine
through vLLM's dev-mode routes (``reload``, the default for a launched vLLM) without an error
reaching any agent, and the records carry the engine's own weight versions: the training calls
(how many of them land after which push depends on timing) and the in-training evaluation at
step 3, which runs after the third push and is sampled by version 3.

A random tiny model solves nothing, so every reward and advantage is 0 and the policy gradient is
zero; AdamW's decoupled weight decay still moves every weight at each step. That is what makes the
pushed weights observable: a recorded call that vLLM labelled version k has the logprobs of
checkpoint step-k, not those of the initial weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from fineenvs.harnesses import check_installed
from fineenvs.paths import REPO_ROOT
from tests.engine_plumbing.vllm_helpers import install_standin

pytestmark = pytest.mark.slow

HARNESSES = ["opencode", "mini_swe_agent"]
TEMPERATURE = 0.8


def _records(out: Path) -> list[dict[str, Any]]:
    from fineenvs.proxy.store import CallStore

    store = CallStore(out / "records")
    calls = []
    for session in sorted((out / "records" / "sessions").iterdir()):
        data = store.read_session(session.name)
        assert not [e for e in data["events"] if e.get("kind") == "upstream_error"], data["events"]
        calls += data["calls"]
    return calls


def _logprobs(model_dir: Path, prompt: list[int], sampled: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + sampled])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / TEMPERATURE
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(sampled)[:, None])[:, 0]


def test_rl_multi_runs_on_the_vllm_standin(tmp_path: Path) -> None:
    problems = check_installed(HARNESSES)
    if problems:
        pytest.fail("the run needs its agent CLIs: " + "; ".join(problems))
    python = install_standin(tmp_path / "standin", gpus=2)  # bin/nvidia-smi lists two stand-in GPUs
    gpu_bin = python.parent
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "fineenvs.run", "+experiment=rl_multi", "model=tiny_lfm2",
        "engine=vllm", f"engine.python={python}", "engine.dtype=float32", "engine.max_model_len=32768",
        f"harness=[{','.join(HARNESSES)}]", "tasks=demo", "tasks.limit=2", "tasks.subset=null",
        "scheduler.group_size=2", "scheduler.max_inflight=2", "scheduler.max_model_calls=3",
        "scheduler.attempt_timeout_seconds=180", "scheduler.passes=3",
        "trainer.max_steps=3", "trainer.per_device_batch_size=1",
        "trainer.gradient_accumulation_steps=1", "trainer.save_steps=1", "trainer.eval_steps=3",
        "eval.subset_during_training=1",
        "trainer.token_budget=16384", "trainer.dtype=float32", "trainer.gradient_checkpointing=false",
        "trainer.learning_rate=1e-2", "trainer.weight_decay=0.5",
        "sampling.max_tokens=32", "logger=none", f"hydra.run.dir={out}",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(PATH=f"{gpu_bin}{os.pathsep}{env['PATH']}", WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=1500)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["weight_pushes"] == 3, summary
    assert set(summary["attempt_exits"]) == {"finished"}, summary["attempt_exits"]

    # The launch: the stand-in ran the exact serve command, on GPU 1; the trainer kept GPU 0.
    assert "trainer GPUs: CUDA_VISIBLE_DEVICES=0" in res.stdout
    log = (out / "engine" / "vllm.log").read_text()
    template = out / "engine" / "lfm2_5_nothink.jinja"
    assert template.is_file() and f"--chat-template {template}" in log.splitlines()[0]
    assert log.splitlines()[0].startswith(f"$ {python.parent / 'vllm'} serve ")
    assert "stand-in (not vLLM 0.33.0)" in log and "CUDA_VISIBLE_DEVICES=1, dev mode True" in log
    # What the trainer drove, in the stand-in's log: announce, then three reload rounds in keep mode.
    routes = [json.loads(line.split("dev route ", 1)[1]) for line in log.splitlines() if "dev route " in line]
    assert [r["new_version"] for r in routes if r["kind"] == "update_weight_version"] == ["0", "1", "2", "3"]
    assert [r["mode"] for r in routes if r["kind"] == "pause"] == ["keep"] * 3
    assert sum(r["kind"] == "reload_weights" for r in routes) == 3

    # Every call carries the engine's own version, and the versions advance with the pushes.
    calls = _records(out)
    assert calls and all(c["logprobs_aligned"] for c in calls)
    versions = {c["weight_version"] for c in calls}
    assert {0, 3} <= versions and versions <= {0, 1, 2, 3}, versions
    for c in calls:
        spans = c["weight_versions"]
        assert spans and spans[0]["start"] == 0 and spans[-1]["end"] == len(c["sampled_ids"])
        assert c["weight_version"] == min(int(s["version"]) for s in spans)

    # The pushed weights are the ones that sampled: a call labelled k has checkpoint step-k's
    # logprobs (to float32 round-off), which differ from the initial weights'.
    initial = Path(
        json.loads((out / "checkpoints" / "step-1" / "trainer_state.json").read_text())["model_dir"]
    )
    checked = 0
    for c in calls:
        spans = c["weight_versions"]
        k = c["weight_version"]
        if len(spans) != 1 or k not in (1, 2, 3):
            continue
        recorded = torch.tensor(c["logprobs"])
        served = _logprobs(out / "checkpoints" / f"step-{k}", c["prompt_ids"], c["sampled_ids"])
        before = _logprobs(initial, c["prompt_ids"], c["sampled_ids"])
        assert float((recorded - served).abs().max()) < 1e-4, (k, c["call_id"])
        assert float((recorded - before).abs().max()) > 1e-3, "the push changed nothing the engine sampled"
        checked += 1
        if checked == 2:
            break
    assert checked, "no call was sampled by a single pushed version"
