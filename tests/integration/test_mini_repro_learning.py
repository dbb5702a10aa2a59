"""Learning, end to end: the reduced mini-reproduction must raise reward and held-out pass@1.

The real loop on a 2-core CPU, nothing scripted around it: the scripted-expert teacher through
the real Pi CLI (in the bwrap sandbox) and the capture proxy, SFT of a random ``tiny_agent`` student
on those rollouts (the base), GRPO from the base through the same agent (real scheduler, rows,
tool-bonus reward, weight pushes), then the evaluation matrix of both checkpoints on held-out eval
tasks (files, columns and answers never seen in training), and the local report. A change that
breaks learning anywhere in that loop (records, rows, advantages, the loss, weight sync,
checkpoints) fails here.

The criterion. Both checkpoints are evaluated once on the same N = 216 held-out tasks (the eval
split's six blocks; 72 per question template) at temperature 0.8, so the comparison is paired, and the noise of the evaluation is the
coin each task's outcome is: under "RL changed nothing", a task solved by one checkpoint and not the
other is equally likely to go either way. RL must win enough of those that an unchanged policy would
do as well with probability below 5 % (exact one-sided sign test, McNemar), and held-out pass@1 and
mean reward (correctness plus the tool bonus) must rise.

RL's setting, and why the test is robust now (experiments/mini_repro/README.md and results/2026-12-03-learning-test-2core.md). With the
recipe's 16 rows per step at lr 3e-4 RL's gain varied from run to run and sometimes RL traded one
question template for another (max falls while rows and sum rise): 7 of 9 runs passed, one failed in
CI (+0.11 on 72 tasks, p = 0.076), one here (79 -> 82 of 216, max 14 -> 3). At 3e-4 the policy swung
between steps (a template solved 8/8, then 0/8, then 7/8). With 24 rows per step (three groups, so a
step usually sees every template) at lr 1e-4, six runs in a row passed, from five different bases,
none losing more than 5 of a template's 72 tasks (the failure above lost 11): 79 -> 109, 83 -> 104,
80 -> 113, 79 -> 115 of 216 (RL again from the bases of earlier runs, the one that had failed among
them, twice) and 83 -> 125 and 66 -> 102 from scratch (the latter this test, alone in 1,853 s), p
from 0.005 to 1.6e-9; the weakest, 41 won / 20 lost, also passes on the first 144 tasks alone
(32 / 16, p = 0.015), which is what the test evaluates since 2026-12-04 (its first two runs so, in
dry runs of CI: 32 -> 70 of 144, 45 won / 7 lost, p = 3.5e-8, 2,245 s; then, with the agents on the
pinned Node 24, 48 -> 75, 36 / 9, p = 3.3e-5, 959 s on a fast hour): 144 tasks instead of 216 cut
the evaluation by a third (~190 s) so that CI fits its 90 minutes on a slow machine. Back to 216
since the next run (LT11, 2026-12-04) failed on 144: 56 -> 67, 25 won / 14 lost, p = 0.054. Its
two checkpoints evaluated again on all 216: 74 -> 102, 46 / 18, p = 3e-4 (on the first 144 of
that evaluation 34 / 15, p = 0.005): RL had worked, and the 144-task evaluation drew an unlucky
sample; a third more tasks narrows that noise for ~190 s (CI's last whole run took 41 minutes). The
slower policy also stops the long tail of steps that draw group after group without signal (49-59
groups in 12 steps, against 91 at 3e-4).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from fineenvs.harnesses import check_installed
from fineenvs.results import sign_test_p

# 15-40 minutes on a 2-core machine, by the hour: its own tier (make test-learning), which .ci/run
# runs after the others (1,109 s on 216 tasks with the default tier beside it; on 144 tasks 896 s,
# and 2,245 s on a slow hour before the pinned Node 24). The limits leave room for a machine ~1.5x
# slower than that slow hour.
pytestmark = [pytest.mark.learning, pytest.mark.timeout(4200)]

EVAL_TASKS = 216  # the eval split's six blocks of 36 (fineenvs/tasks/mini.py)
ALPHA = 0.05
RL_STEPS = 12
RL_ROWS_PER_STEP = 24
RL_LEARNING_RATE = 1e-4


def test_rl_raises_reward_and_held_out_pass_at_1(tmp_path: Path) -> None:
    problems = check_installed(["pi"])
    assert not problems, "the learning test runs the real Pi CLI: " + "; ".join(problems)
    assert shutil.which("bwrap"), "the recipe runs agents in the bwrap sandbox: apt-get install bubblewrap"
    out = tmp_path / "mini"
    cmd = [
        sys.executable,
        "-m",
        "fineenvs.run",
        "+experiment=mini_repro",
        f"output_dir={out}",
        "seed=0",
        "recipe.stages=[teacher,base,rl_one,eval,report]",
        "recipe.harnesses=[pi]",
        "recipe.base_harness=pi",
        "recipe.base_sees_mix=false",
        "recipe.base_epochs=2",
        # The teacher habit its setting was chosen and passed with (LT1-LT16, experiments/mini_repro/
        # results/2026-12-03-learning-test-2core.md); the recipe's default became verify on
        # 2026-12-07, a change for the tool-call bonus's control that this test does not measure.
        "recipe.teacher_habit=look",
        f"recipe.rl_steps={RL_STEPS}",
        # Groups of 8: with groups of 4 the few groups with signal in a step came from one template.
        "recipe.group_size=8",
        # 24 rows (three groups) a step at lr 1e-4, not the recipe's 16 at 3e-4: at 3e-4 the policy
        # swung between steps (a template 8/8 solved, then 0/8, then 7/8) and RL sometimes traded one
        # question template for another; at 1e-4 with three groups a step it kept all three.
        f"recipe.rl_rows_per_step={RL_ROWS_PER_STEP}",
        f"recipe.rl_learning_rate={RL_LEARNING_RATE}",
        f"recipe.rl_one_learning_rate={RL_LEARNING_RATE}",  # the stage this test measures
        # A step ends after 12 groups drawn: a policy that always solves or always fails its training
        # tasks (seen after 8 steps) would otherwise keep a step drawing forever.
        "recipe.rl_max_groups_per_step=12",
        "recipe.eval_every=100",  # no in-training evaluation: the matrix is the measure
        f"recipe.eval_tasks={EVAL_TASKS}",
    ]
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=4000)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]

    results = json.loads((out / "eval" / "eval" / "results.json").read_text())
    base, rl = results["checkpoints"]
    assert "/base/" in base and "/rl_one/" in rl
    assert results["tasks"] == EVAL_TASKS and all(t.startswith("mini-eval-") for t in _eval_tasks(out))
    p_base = results["pass_at_1"][base]["pi"]
    p_rl = results["pass_at_1"][rl]["pi"]
    assert 0.0 < p_base < 1.0, f"the base must start learning: pass@1 {p_base}"
    solved = _solved(out)
    wins = sum(1 for t in solved if solved[t][rl] and not solved[t][base])
    losses = sum(1 for t in solved if solved[t][base] and not solved[t][rl])
    p = sign_test_p(wins, losses)
    assert p_rl > p_base and p < ALPHA, (
        f"held-out pass@1 {p_base:.3f} -> {p_rl:.3f}: {wins} won, {losses} lost, p={p:.3f}"
    )
    rewards = _rewards(out)
    assert statistics.fmean(rewards[rl]) > statistics.fmean(rewards[base]), rewards

    steps = [json.loads(line) for line in (out / "rl_one" / "metrics.jsonl").read_text().splitlines()]
    assert sum(1 for s in steps if "train/ratio" in s) == RL_STEPS
    assert all(abs(s["train/ratio"] - 1.0) < 0.05 for s in steps if "train/ratio" in s)
    table = (out / "mini_repro.md").read_text()
    assert "| base |" in table and "| rl_one |" in table
    assert (out / "report" / "index.html").is_file()


def _solved(out: Path) -> dict[str, dict[str, bool]]:
    solved: dict[str, dict[str, bool]] = {}
    for line in (out / "eval" / "eval" / "attempts.jsonl").read_text().splitlines():
        a = json.loads(line)
        solved.setdefault(a["task_id"], {})[a["checkpoint"]] = float(a["reward"]) >= 1.0
    return solved


def _rewards(out: Path) -> dict[str, list[float]]:
    rewards: dict[str, list[float]] = {}
    for line in (out / "eval" / "eval" / "attempts.jsonl").read_text().splitlines():
        a = json.loads(line)
        rewards.setdefault(a["checkpoint"], []).append(float(a["reward"]))
    return rewards


def _eval_tasks(out: Path) -> set[str]:
    lines = (out / "eval" / "eval" / "attempts.jsonl").read_text().splitlines()
    return {json.loads(line)["task_id"] for line in lines}
