"""``SFTSettings``: every setting of SFT on teacher rollouts, its default and the reason, written once.

It is the Hydra schema of ``conf/trainer/sft.yaml`` (YAML key ``trainer.<field>``), what the
teacher collection and the SFT job read, and what ``train_sft`` trains with. Defaults are the
published SFT baseline's: a full fine-tune, 2 epochs, LR 3e-6, effective batch 8. This module
imports neither torch nor TRL.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fineenvs.train.trainer_settings import TrainerSettings, not_one_of

SFT_DTYPES = ("bfloat16", "float16", "float32")


@dataclass
class SFTSettings(TrainerSettings):
    num_train_epochs: float = 2.0
    max_steps: int = -1
    """-1: ``num_train_epochs`` decides."""
    per_device_batch_size: int = 1
    gradient_accumulation_steps: int = 8
    max_length: int = 40960
    teacher_attempts_per_task: int = 3
    """job=collect_teacher: attempts per task and harness until one is correct."""
    teacher_dir: str | None = None
    """job=sft: output directory of the ``job=collect_teacher`` run whose kept sessions are trained on."""
    rollout_slices: dict[str, list[int]] = field(default_factory=dict)
    """job=sft: per harness, ``[start, stop]`` or ``[start]`` (to the end): train on that slice of the
    harness's kept rollouts in task-id order (``{pi: [24], opencode: [0, 24]}``: Pi's from the 25th
    on, OpenCode's first 24; on the command line one key at a time, ``+trainer.rollout_slices.pi=[24]``);
    a harness not named keeps all. Lets two trainings split one collection, e.g. the
    mini-reproduction's SFT-on-the-mix baseline on rollouts its base never saw. Applied before
    ``max_rollouts_per_harness``."""
    max_rollouts_per_harness: int | None = None
    """job=sft: at most this many kept rollouts per harness (the first by task id); None keeps all."""
    merge_turns: bool = False
    """job=sft: one example per rollout (its turns' contexts extend each other) instead of one per
    assistant turn (published): the same supervised tokens in the same contexts, each context
    forwarded once; the loss mean is then per rollout, not per turn (fineenvs.train.sft_trainer.merge_turns)."""
    save_steps: int = 50
    dtype: str = "bfloat16"
    """Compute dtype on an accelerator (mixed precision over float32 master weights: bf16 weights
    would round away updates of LR 3e-6); on CPU everything is float32."""
    gradient_checkpointing: bool = True
    seed: int = 0
    """The run's seed (``conf/trainer/sft.yaml``: ``${seed}``)."""

    def problems(self) -> list[str]:
        """Every bad field, each with the fix, as ``trainer.<field>`` (the YAML key)."""
        p = not_one_of("dtype", self.dtype, SFT_DTYPES, "trainer.dtype=bfloat16")
        if self.teacher_attempts_per_task < 1:
            p.append(
                f"trainer.teacher_attempts_per_task must be >= 1 (got {self.teacher_attempts_per_task}). "
                "Fix: trainer.teacher_attempts_per_task=3"
            )
        if self.max_rollouts_per_harness is not None and self.max_rollouts_per_harness < 1:
            p.append(
                f"trainer.max_rollouts_per_harness must be >= 1 or null (got {self.max_rollouts_per_harness}): it "
                "caps the teacher rollouts kept per harness. Fix: trainer.max_rollouts_per_harness=null (keep all)"
            )
        for harness, bounds in self.rollout_slices.items():
            if len(bounds) not in (1, 2) or bounds[0] < 0 or (len(bounds) == 2 and bounds[1] <= bounds[0]):
                p.append(
                    f"trainer.rollout_slices.{harness}={list(bounds)} is not a slice: it must be [start, stop] "
                    "with 0 <= start < stop (rollouts in task-id order, stop excluded), or [start] for all "
                    f"from start on. Fix: e.g. +trainer.rollout_slices.{harness}=[0,24]"
                )
        return p

    def slice_stop(self, harness: str, kept: int) -> int | None:
        """Where ``rollout_slices``' slice of ``harness`` ends among its ``kept`` rollouts (None: not sliced)."""
        bounds = self.rollout_slices.get(harness)
        if bounds is None:
            return None
        return bounds[1] if len(bounds) > 1 else max(kept, bounds[0] + 1)

    def collection_problems(self, kept: dict[str, int]) -> list[str]:
        """What ``rollout_slices`` asks of a teacher collection that kept ``kept`` rollouts per harness
        and it lacks (the dry run's preflight and the SFT job check the same)."""
        p: list[str] = []
        for harness, bounds in self.rollout_slices.items():
            n = kept.get(harness, 0)
            stop = self.slice_stop(harness, n)
            if stop is not None and stop > n:
                p.append(
                    f"trainer.rollout_slices.{harness}={list(bounds)} asks for {harness} rollouts up to "
                    f"#{stop}, but the collection in {self.teacher_dir} kept {n}. Fix: collect more "
                    f"(job=collect_teacher with tasks.limit={stop} in {harness}), or lower the slice"
                )
        return p
