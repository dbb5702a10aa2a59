"""Teacher collection → SFT → checkpoint, through the real entry point, proxy and mini-swe-agent CLI.

The teacher is the harness tests' scripted policy (``GoldEngine``) attached with ``engine.url=``:
a tiny random model cannot solve a task, and the SFT path needs correct rollouts. It writes each
task's gold answer, read from the hidden answer in this fixture only; task 2 is answered wrongly
on its first attempt and task 3 always, so the run must retry, stop at the first correct attempt
and keep nothing for task 3.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from fineenvs.engine.generation import Generator, SamplingParams
from fineenvs.harnesses import check_installed
from fineenvs.paths import REPO_ROOT
from fineenvs.proxy.store import CallStore
from fineenvs.tasks import load_tasks
from fineenvs_recipes.tiny import ensure_tiny_model
from tests.sft.gold_engine import WRONG, GoldEngine

pytestmark = pytest.mark.slow

DEMO_SEED = 20260701  # conf/tasks/demo.yaml


def _run(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "fineenvs.run", *args, "logger=none", f"hydra.run.dir={out}"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=900)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    return res


def test_collect_teacher_then_sft_gives_a_loadable_checkpoint(tmp_path: Path) -> None:
    problems = check_installed(["mini_swe_agent"])
    if problems:
        pytest.fail("the e2e SFT test needs mini-swe-agent: " + "; ".join(problems))
    tasks = list(load_tasks("demo", split="train", seed=DEMO_SEED))
    questions = {str(t.metadata["question"]): t.hidden.gold for t in tasks}
    first3 = [str(t.metadata["question"]) for t in tasks[:3]]
    engine = GoldEngine(questions, wrong_first={first3[1]}, always_wrong={first3[2]}).start()
    teacher = tmp_path / "teacher"
    try:
        res = _run(
            teacher,
            "+experiment=collect_teacher",
            "model=tiny_qwen",
            f"engine.url={engine.url}",
            "harness=mini_swe_agent",
            "tasks=demo",
            "tasks.subset=null",
            "tasks.limit=3",
            "trainer.teacher_attempts_per_task=3",
            "scheduler.attempt_timeout_seconds=120",
        )
    finally:
        engine.stop()
    assert "fineenvs teacher collection summary" in res.stdout
    assert engine.writes == {
        first3[0]: [questions[first3[0]]],
        first3[1]: [WRONG, questions[first3[1]]],
        first3[2]: [WRONG] * 3,
    }
    summary = json.loads((teacher / "summary.json").read_text())
    assert summary["attempts"] == 6 and summary["kept_rollouts"] == 2 and summary["tasks_tried"] == 3
    assert summary["per_harness"]["mini_swe_agent"]["correct"] == 2
    attempts = [json.loads(line) for line in (teacher / "attempts.jsonl").read_text().splitlines()]
    assert [a["correct"] for a in attempts if a["task_id"] == tasks[1].task_id] == [False, True]
    manifest = json.loads((teacher / "teacher_manifest.json").read_text())
    kept = {s["task"]: s for s in manifest["sessions"]}
    assert set(kept) == {tasks[0].task_id, tasks[1].task_id}
    assert kept[tasks[1].task_id]["attempt_id"].endswith("-a1")
    answer = Path(kept[tasks[1].task_id]["attempt_dir"]) / "work" / "answer.txt"
    assert answer.read_text().strip() == questions[first3[1]]
    store = CallStore(teacher / "records", fsync=False)
    turns = sum(len(store.read_session(s["session_id"])["calls"]) for s in manifest["sessions"])
    assert turns >= 4  # mini-swe-agent: write the answer, then submit

    student = tmp_path / "sft"
    res = _run(
        student,
        "+experiment=sft_opencode",
        "model=tiny_qwen",
        "engine=transformers",
        "harness=mini_swe_agent",
        "tasks=demo",
        "tasks.subset=null",
        f"trainer.teacher_dir={teacher}",
        "trainer.dtype=float32",
        "trainer.gradient_checkpointing=false",
        "trainer.per_device_batch_size=2",
        "trainer.gradient_accumulation_steps=1",
        "trainer.num_train_epochs=1",
        "trainer.learning_rate=1e-3",
        "trainer.max_length=8192",
    )
    assert "fineenvs SFT summary" in res.stdout
    sft = json.loads((student / "summary.json").read_text())
    assert sft["teacher_rollouts"] == 2 and sft["examples"] == turns
    assert sft["steps"] == (turns + 1) // 2
    assert sft["first_loss"] is not None and math.isfinite(sft["train_loss"])
    rows = [
        json.loads(line) for line in (student / "sft_dataset" / "examples.jsonl").read_text().splitlines()
    ]
    assert all(r["rerendered"] and r["harness"] == "mini_swe_agent" for r in rows)
    checkpoint = Path(sft["checkpoint"])
    assert (checkpoint / "COMPLETE").exists()
    trained = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(ensure_tiny_model("tiny_qwen"), dtype=torch.float32).eval()
    # The student learned the teacher's turns: lower NLL on the supervised tokens than before.
    assert _supervised_nll(trained, rows) < _supervised_nll(base, rows)
    # The embedded engine serves the checkpoint as a model.
    served = Generator(checkpoint)
    prompt = rows[0]["input_ids"][: rows[0]["prompt_tokens"]]
    out = served.generate(prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=0, logprobs=True))
    assert 1 <= len(out.token_ids) <= 8 and all(lp <= 0 for lp in out.logprobs)

    # Teacher collection -> SFT -> evaluation: the SFT checkpoint evaluated by the eval job.
    evaluated = tmp_path / "eval"
    _run(
        evaluated,
        "+experiment=eval",
        "model=tiny_qwen",
        "engine=transformers",
        "harness=mini_swe_agent",
        "tasks=demo",
        f"eval.checkpoints=[{checkpoint}]",
        "eval.limit=1",
        "scheduler.max_model_calls=3",
        "scheduler.attempt_timeout_seconds=120",
        "sampling.max_tokens=32",
    )
    results = json.loads((evaluated / "eval" / "results.json").read_text())
    (row,) = results["pass_at_1"].values()
    assert set(row) == {"mini_swe_agent"} and 0.0 <= row["mini_swe_agent"] <= 1.0

    # The multi-harness recipe on the LFM-family (short-convolution hybrid) student, its own harness
    # mix (paper_mix, which includes the teacher's mini-swe-agent rollouts): re-rendered with the
    # student's LFM2.5 template and trained.
    multi = tmp_path / "sft_multi"
    res = _run(
        multi,
        "+experiment=sft_multi",
        "model=tiny_lfm2",
        "engine=transformers",
        "tasks=demo",
        "tasks.subset=null",
        f"trainer.teacher_dir={teacher}",
        "trainer.dtype=float32",
        "trainer.gradient_checkpointing=false",
        "trainer.per_device_batch_size=2",
        "trainer.gradient_accumulation_steps=1",
        "trainer.num_train_epochs=1",
        "trainer.max_length=8192",
    )
    lfm = json.loads((multi / "summary.json").read_text())
    assert lfm["teacher_rollouts"] == 2 and lfm["examples"] == turns
    assert (Path(lfm["checkpoint"]) / "COMPLETE").exists()


def _supervised_nll(model: torch.nn.Module, rows: list[dict[str, list[int]]]) -> float:
    total, count = 0.0, 0
    for r in rows:
        ids = torch.tensor([r["input_ids"]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1]
        mask = torch.tensor(r["assistant_masks"][1:], dtype=torch.bool)
        nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")[mask]
        total, count = total + float(nll.sum()), count + int(mask.sum())
    return total / count
