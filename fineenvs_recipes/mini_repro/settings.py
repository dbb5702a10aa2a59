"""The mini-reproduction's settings: the ``recipe/mini_repro_schema`` Hydra schema.

Registered through the ``fineenvs.recipes`` entry point ``mini_repro`` (``pyproject.toml``); the
option ``conf/recipe/mini_repro.yaml`` names it, and ``+experiment=mini_repro`` chooses it. This
module imports nothing from the library at import time: the library's config module loads it while
it registers its own schemas.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fineenvs.config import Recipe, RunConfig

STAGES = (
    "teacher", "base", "rl_one", "rl_mix", "rl_mix_nobonus", "sft_mix", "eval", "eval_unseen", "report"
)  # fmt: skip
RL_BATCH = 4
"""Rows per forward/backward pass of the mini-reproduction's RL stages."""
TEACHER_POLICIES = {"verify": "expert", "look": "expert_look"}
"""``recipe.teacher_habit`` -> the scripted policy (``engine.policy``) of the teacher stage."""


@dataclass
class MiniReproSettings:
    """``recipe=mini_repro``: the stages of the CPU learning mini-reproduction (``recipe.py``), its
    knobs set as ``recipe.<knob>=...``.

    Each stage is its own run of ``python -m fineenvs.run`` in ``<output_dir>/<stage>``; a stage
    whose ``STAGE_DONE`` file exists is skipped, so a rerun resumes."""

    stages: list[str] = field(default_factory=lambda: list(STAGES))
    """The stages to run, in ``STAGES``' order. ``rl_mix_nobonus`` is ``rl_mix`` with
    ``reward=correctness``: the tool bonus's control (same base, seed and steps), against which the
    report measures the bonus's tool-call cut; ``eval_unseen`` evaluates every checkpoint in
    ``unseen_harnesses``."""
    harnesses: list[str] = field(default_factory=lambda: ["pi", "mini_swe_agent", "opencode"])
    """The mix (teacher collection, RL across harnesses, SFT on the mix, evaluation)."""
    unseen_harnesses: list[str] = field(default_factory=lambda: ["codex"])
    """Harnesses no stage trains in and the teacher never collects in: the ``eval_unseen`` stage
    evaluates every checkpoint in them on the same held-out tasks (does RL across the mix transfer
    to a harness it never saw? the question the paper left open). Codex: the cheapest candidate
    (~6 s an attempt, 9.2k prompt tokens a call), and the student runs to completion there; its shell
    tool is ``exec_command`` {``cmd``}, not the mix's ``bash`` {``command``}, so near-zero pass@1
    there may be the tool interface not transferring (``[kilo]``: ``bash`` as in the mix, ~7x slower;
    experiments/mini_repro/results/2026-12-07-unseen-harness-probe-2core.md). Empty: no
    ``eval_unseen`` stage."""
    base_harness: str = "pi"
    """The harness the base is mostly trained in (all its training tasks; see ``base_sees_mix``) and
    RL'd in alone.
    Pi, not Mini-SWE-Agent: Pi sends the task as the last message, right before the student's
    reply; Mini-SWE-Agent puts it first in a 1.9k-token message, and the 4-layer student did not
    learn which command a question asks for from that far back (experiments/mini_repro/README.md)."""
    rl_one_harness: str | None = None
    """The harness ``rl_one`` trains in alone (None: ``base_harness``). ``opencode`` is the published
    OpenCode-only form, with room to lift where the base harness (Pi) is near its ceiling, and with
    prompts four times as long, so a slower stage (measured: experiments/mini_repro/results/)."""
    teacher_habit: str = "verify"
    """The teacher's habitual extra tool call on part of the tasks, which its students inherit and
    the tool-call bonus can train away (``teacher.py``): ``verify`` reads the answer back after
    solving, on three tasks in four (it cannot change the grade, so only the bonus has a reason to
    drop it), ``look`` looks at the data first, on one in two (the students that looked solved less
    often, so RL without the bonus pruned it too; the recipe's habit until 2026-12-07)."""
    teacher_tasks: int | None = None
    """Training tasks the teacher attempts in the base harness (None: the whole train split)."""
    base_mix_tasks: int = 24
    """Training tasks of each other harness of the mix whose teacher rollouts the base also trains
    on (with ``base_sees_mix``; long prompts are costly on CPU)."""
    base_sees_mix: bool = True
    """The base's SFT data: the base harness's rollouts plus ``base_mix_tasks`` rollouts of each
    other harness (True), or the base harness's alone (False). With False the 4-layer student solves
    nothing outside the base harness, so RL across the mix has signal in one harness only."""
    sft_mix_tasks: int = 24
    """Teacher rollouts per harness of the SFT-on-the-mix baseline (``sft_mix``): those of the first
    ``sft_mix_tasks`` training tasks of every harness. In the other harnesses of the mix they are
    held out of the base's data, so the baseline learns from rollouts its starting point never saw,
    as the published SFT baseline does (the teacher attempts ``sft_mix_tasks + base_mix_tasks`` tasks
    there); in the base harness see ``hold_out_base_harness``. Held out only when the ``sft_mix``
    stage runs. Trained on rollouts the base had seen, at the base's learning rate, it fell below
    its base (the results: experiments/mini_repro/results/)."""
    hold_out_base_harness: bool = False
    """Hold the base harness's ``sft_mix_tasks`` rollouts out of the base too. Off: the base trains
    on all of them and the SFT baseline's base-harness share is rollouts the base saw. Holding them
    out looked costly to the base, though the bases' spread between seeds is about as wide
    (experiments/mini_repro/results/)."""
    sft_mix_epochs: float = 1.0
    sft_mix_learning_rate: float = 3.0e-4
    """A tenth of the base's: one more epoch at the base's 3e-3 undid part of the base, at 3e-4 the
    same data lifted it (experiments/mini_repro/results/)."""
    base_epochs: float = 2.0
    sft_learning_rate: float = 3.0e-3
    sft_gradient_accumulation: int = 2
    """Rollouts per SFT optimizer step (one example per rollout: ``trainer.merge_turns``)."""
    rl_steps: int = 12
    rl_learning_rate: float = 3.0e-4
    """``rl_mix`` and ``rl_mix_nobonus``, with 24 rows per step. At 1e-4 (the learning test's
    setting, with the ``look`` habit) the 12 steps moved the ``verify`` students' tool calls but
    not their held-out pass@1; at 3e-4 the bonus's cut showed against its control
    (experiments/mini_repro/results/2026-12-07-mini-repro-run-r-2core.md)."""
    rl_one_learning_rate: float | None = 1.0e-4
    """``rl_one``'s (None: ``rl_learning_rate``). Its 12 steps put every row into one harness's
    format: at 3e-4 it lost pass@1 in the harnesses it did not train in; at 1e-4 it moves few
    cells, most of them up in its own harness (experiments/mini_repro/results/)."""
    rl_max_groups_per_step: int | None = 12
    """``trainer.dynamic_sampling_max_groups`` of the RL stages: a step ends after this many groups
    drawn, with the signal groups it has (None: only when its batch is full, with which a base that
    never solves a template can stall a step for good)."""
    group_size: int = 8
    rl_rows_per_step: int = 24
    """Rows (attempts; one per attempt in Pi) per GRPO step of the RL stages, a multiple of 4 (the
    per-device batch): three groups of 8, so a step usually sees every template (smaller steps:
    experiments/mini_repro/results/)."""
    eval_tasks: int | None = 36
    """Held-out eval-split tasks per harness in the final matrix (None: all 216). On 18 an RL gain
    seen on 36 was lost in the noise (experiments/mini_repro/results/)."""
    eval_every: int = 6
    """RL steps between in-training evaluations (pass@1 over steps); above rl_steps: none."""
    eval_tasks_during_training: int = 12
    """Held-out tasks per harness in each in-training evaluation."""
    overrides: list[str] = field(default_factory=list)
    """Extra Hydra overrides given to every stage, after the recipe's ``seed`` (on the command line
    quoted: ``recipe.overrides=['sampling.temperature=1.0']``)."""

    def recipe(self, run: RunConfig) -> Recipe:
        from fineenvs_recipes.mini_repro.recipe import MiniRepro

        return MiniRepro(run, self)

    def problems(self, run: RunConfig) -> list[str]:
        """Every bad knob, each with the fix (``validate`` reports them at compose time)."""
        p: list[str] = []
        unknown = [s for s in self.stages if s not in STAGES]
        if unknown or not self.stages:
            p.append(f"recipe.stages has {unknown or 'nothing'}; choose from {list(STAGES)} (in order)")
        rates = {"rl_learning_rate": self.rl_learning_rate, "rl_one_learning_rate": self.rl_one_learning_rate}
        for name, rate in rates.items():
            if rate is not None and not rate > 0:
                p.append(
                    f"recipe.{name}={rate}: a learning rate must be above 0. Fix: e.g. 1e-4 (the defaults: 3e-4 across the mix, 1e-4 in one harness)"
                )
        if self.rl_rows_per_step < RL_BATCH or self.rl_rows_per_step % RL_BATCH:
            p.append(
                f"recipe.rl_rows_per_step={self.rl_rows_per_step}: the RL stages train {RL_BATCH} rows per "
                f"pass and accumulate whole passes into a step. Fix: a multiple of {RL_BATCH}, e.g. 8 or 16"
            )
        if self.sft_mix_tasks < 1 or self.base_mix_tasks < 1:
            p.append(
                f"recipe.sft_mix_tasks={self.sft_mix_tasks}, base_mix_tasks={self.base_mix_tasks}: each is a number of "
                "training tasks per harness and must be >= 1. Fix: the defaults, 24 each (to drop the SFT "
                "baseline, leave sft_mix out of recipe.stages; to train the base on one harness, "
                "recipe.base_sees_mix=false)"
            )
        if "sft_mix" in self.stages and self.teacher_tasks is not None:
            if self.hold_out_base_harness and self.teacher_tasks <= self.sft_mix_tasks:
                p.append(
                    f"recipe.teacher_tasks={self.teacher_tasks} leaves the base no {self.base_harness} rollouts: the "
                    f"first sft_mix_tasks={self.sft_mix_tasks} are held out for the sft_mix stage "
                    "(hold_out_base_harness). Fix: teacher_tasks above sft_mix_tasks, or null (the whole train split)"
                )
            if self.teacher_tasks < self.sft_mix_tasks:
                p.append(
                    f"recipe.teacher_tasks={self.teacher_tasks} is below sft_mix_tasks={self.sft_mix_tasks}: the sft_mix "
                    f"stage trains on the teacher's first {self.sft_mix_tasks} {self.base_harness} rollouts. Fix: "
                    "teacher_tasks at least sft_mix_tasks, or null (the whole train split)"
                )
        if self.teacher_habit not in TEACHER_POLICIES:
            p.append(
                f"recipe.teacher_habit={self.teacher_habit!r} is not a habit of the scripted teacher. Fix: one of "
                f"{sorted(TEACHER_POLICIES)} (verify: reads its answer back after solving; look: looks at the "
                "data first)"
            )
        seen = [h for h in self.unseen_harnesses if h in self.harnesses]
        if seen:
            p.append(
                f"recipe.unseen_harnesses has {seen}, which recipe.harnesses={self.harnesses} trains in: an "
                "unseen harness is one no stage trains in and the teacher never collects in. Fix: remove "
                "it from one of the two lists"
            )
        if self.rl_one_harness is not None and self.rl_one_harness not in self.harnesses:
            p.append(
                f"recipe.rl_one_harness={self.rl_one_harness} is not in recipe.harnesses={self.harnesses}: rl_one "
                "is compared with the base in the harness it trained in, and the base is evaluated in the mix "
                "only. Fix: a harness of recipe.harnesses, or null (the base harness)"
            )
        if self.base_harness not in self.harnesses:
            p.append(
                f"recipe.base_harness={self.base_harness} is not in recipe.harnesses={self.harnesses}: the base "
                "is evaluated in every harness of the mix. Fix: add it to recipe.harnesses"
            )
        seeded = [o for o in self.overrides if o.split("=", 1)[0].lstrip("+~") == "seed"]
        if seeded:
            p.append(
                f"recipe.overrides has {seeded}: the recipe's own seed goes to every stage, and an override "
                "after it would win silently (in a seed sweep, every job would run at that one seed). "
                "Fix: seed=<n> on the recipe's command line"
            )
        return p
