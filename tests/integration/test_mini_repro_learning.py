"""Learning, end to end: the reduced mini-reproduction must raise reward and held-out pass@1.

The real loop on a 2-core CPU, nothing scripted around it: the scripted-expert teacher through
the real Mini-SWE-Agent CLI and the capture proxy, SFT of a random tiny student on those rollouts
(the base), GRPO from the base through the same agent (real scheduler, rows, tool-bonus reward,
weight pushes), then the evaluation matrix of both checkpoints on held-out eval tasks (files,
columns and answers never seen in training), and the local report. A change that breaks learning
anywhere in that loop (records, rows, advantages, the loss, weight sync, checkpoints) fails here.

The margin. Each checkpoint is evaluated once per task at temperature 0.8 on N held-out tasks, so
a pass@1 estimate p has a sampling standard deviation of sqrt(p(1 - p) / N) <= 0.5 / sqrt(N); the
difference of two independent estimates has at most 0.5 * sqrt(2 / N) (0.12 at N = 36). The test
asks for a rise of at least two such standard deviations (0.24 at N = 36), so an unchanged policy
passes it by chance with probability < 3 % even in the worst case p = 0.5, and far less nearer the
ends. The rise is expected from RL sharpening a base that samples the right command only part
of the time; it has not been measured yet (experiments/mini_repro/README.md), hence the marker.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fineenvs.harnesses import check_installed

# Not in CI yet: with the RL settings tried so far held-out pass@1 does not rise (lr 5e-4: 0.42 ->
# 0.42; lr 1e-3: the policy collapses), see experiments/mini_repro/README.md. Run: pytest -m learning
pytestmark = pytest.mark.learning

EVAL_TASKS = 36
MARGIN = 2 * 0.5 * math.sqrt(2 / EVAL_TASKS)


def test_rl_raises_reward_and_held_out_pass_at_1(tmp_path: Path) -> None:
    problems = check_installed(["mini_swe_agent"])
    assert not problems, "the learning test runs the real Mini-SWE-Agent CLI: " + "; ".join(problems)
    out = tmp_path / "mini"
    cmd = [
        sys.executable,
        "-m",
        "fineenvs.run",
        "+experiment=mini_repro",
        f"output_dir={out}",
        "seed=0",
        "mini_repro.stages=[teacher,base,rl_one,eval,report]",
        "mini_repro.harnesses=[mini_swe_agent]",
        "mini_repro.teacher_tasks=48",
        "mini_repro.base_epochs=3",
        "mini_repro.rl_steps=8",
        "mini_repro.eval_every=100",  # no in-training evaluation: the matrix is the measure
        f"mini_repro.eval_tasks={EVAL_TASKS}",
    ]
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]

    results = json.loads((out / "eval" / "eval" / "results.json").read_text())
    base, rl = results["checkpoints"]
    assert "/base/" in base and "/rl_one/" in rl
    assert results["tasks"] == EVAL_TASKS and all(t.startswith("mini-eval-") for t in _eval_tasks(out))
    p_base = results["pass_at_1"][base]["mini_swe_agent"]
    p_rl = results["pass_at_1"][rl]["mini_swe_agent"]
    assert 0.0 < p_base < 1.0, f"the base must start learning: pass@1 {p_base}"
    assert p_rl - p_base >= MARGIN, f"held-out pass@1 {p_base:.3f} -> {p_rl:.3f}, needs +{MARGIN:.3f}"

    steps = [json.loads(line) for line in (out / "rl_one" / "metrics.jsonl").read_text().splitlines()]
    rewards = [s["reward/mean"] for s in steps if "reward/mean" in s]
    assert len(rewards) == 8
    half = len(rewards) // 2
    assert sum(rewards[half:]) / half > sum(rewards[:half]) / half, rewards
    assert all(abs(s["train/ratio"] - 1.0) < 0.05 for s in steps if "train/ratio" in s)
    table = (out / "mini_repro.md").read_text()
    assert "| base |" in table and "| rl_one |" in table
    assert (out / "report" / "index.html").is_file()


def _eval_tasks(out: Path) -> set[str]:
    lines = (out / "eval" / "eval" / "attempts.jsonl").read_text().splitlines()
    return {json.loads(line)["task_id"] for line in lines}
