"""``GRPOSettings``: every setting of RL training, its default and the reason, written once.

It is the Hydra schema of ``conf/trainer/grpo.yaml`` (YAML key ``trainer.<field>``), what the RL
job reads (batching, dynamic sampling, checkpoints, evaluation) and what ``CapturedGRPOTrainer``
trains with: no copy of it elsewhere. Defaults are the published runs'. This module imports
neither torch nor TRL, so composing a config stays cheap; ``fineenvs.train.trl_compat`` checks at
import that the names below match the pinned TRL.
"""

from __future__ import annotations

from dataclasses import dataclass

from fineenvs.train.trainer_settings import TrainerSettings, not_one_of

TRL_VERSION = "1.16.0"
MULTIPLIED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo")
"""TRL 1.16 GRPO loss types whose per-token loss multiplies the importance weight."""
LOSS_TYPES = (*MULTIPLIED_LOSS_TYPES, "vespo")
CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
IMPORTANCE_SAMPLING = ("none", "tis", "mask")
NORMALISATIONS = ("per_token", "per_attempt", "per_row", "loss_type")
PREFIX_SHARING = ("shared", "padded")
SCALE_REWARDS = ("group", "batch", "none")
TRAINER_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class GRPOSettings(TrainerSettings):
    max_steps: int = 1000
    per_device_batch_size: int = 4
    """Rows per forward pass on the padded path (``prefix_sharing=shared`` forwards a tree instead)."""
    gradient_accumulation_steps: int = 4
    """Micro-batches per optimizer step: the RL job hands each step about
    ``per_device_batch_size * gradient_accumulation_steps * processes`` rows; the trainer trains all
    rows it gets in one optimizer step whatever their number."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: groups whose graded rewards are all equal (no learning signal) are
    counted and left out of the batch, so every optimizer step has signal. Off (published): such
    groups train with advantage 0, and AdamW's momentum still moves the weights on a step whose
    gradient is all zero."""
    dynamic_sampling_max_groups: int | None = None
    """With ``dynamic_sampling``: after this many groups drawn for one step, train on the groups with
    signal at hand even if their rows fall short of a full batch (DAPO's ``max_num_gen_batches``).
    None: draw until the batch is full, which never ends once the policy always solves or always
    fails every task."""
    dynamic_sampling_patience: int | None = 100
    """With ``dynamic_sampling``: groups in a row without signal (all rewards equal) after which the
    run stops with an error instead of drawing on: no step can form, with or without
    ``dynamic_sampling_max_groups``, once the policy solves every task or none (checkpoints and the
    rollout state are kept; the error says how the groups ended). None: draw until the schedule
    runs out."""
    loss_type: str = "dapo"
    """A TRL GRPO loss type (``LOSS_TYPES``)."""
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    """KL weight against the initial weights (TRL's estimator); 0 loads no reference model."""
    scale_rewards: str = "group"
    """group | batch | none: what the advantages are divided by (the group's reward std, ...)."""
    normalisation: str = "per_token"
    """per_token (published) | per_attempt | per_row | loss_type (TRL's aggregation), decided over
    the whole step (``fineenvs.train.batching``)."""
    importance_sampling: str = "none"
    """none (published: staleness is bounded by the scheduler) | tis (truncate the importance weight
    at ``importance_sampling_clip``) | mask (drop tokens whose ratio leaves [1/C, C])."""
    importance_sampling_clip: float = 3.0
    importance_sampling_level: str = "token"
    """token | sequence (GSPO)."""
    temperature: float = 1.0
    """The trainer divides logits by it; it must be the engine's sampling temperature, so
    ``conf/trainer/grpo.yaml`` sets it to ``${sampling.temperature}``."""
    token_budget: int = 40960
    """Longest row trained; longer rows are left out and counted (``train/rows_over_budget``)."""
    max_completion_length: int = 16384
    """Only ``dr_grpo``'s constant normaliser uses it."""
    optim: str = "adamw_torch"
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    weight_sync_interval: int = 1
    """Optimizer steps between weight pushes to the engine."""
    save_steps: int = 50
    eval_steps: int = 100
    eval_at_end: bool = True
    """Whether the in-training hook evaluates the last step's checkpoint when that step is an eval
    step (``max_steps % eval_steps == 0``); off where the job evaluates that checkpoint in full
    afterwards (the mini-reproduction's eval stage)."""
    dtype: str = "bfloat16"
    """Compute dtype of the forward passes (autocast); weights, gradients and AdamW state stay
    float32, as plain bf16 weights would round the updates away at lr 3e-6."""
    gradient_checkpointing: bool = True
    prefix_sharing: str = "shared"
    """``shared``: the prefixes the step's rows share (an attempt's history, a group's prompt) are
    computed once, branches continuing from their state (``fineenvs.train.shared``); ``padded``:
    every row from its first token. Equal gradients; one process only (under several, padded)."""
    seed: int = 0
    """The run's seed (``conf/trainer/grpo.yaml``: ``${seed}``)."""
    process_timeout_s: int = 6 * 3600
    """Under several processes, how long the others may wait in a collective for the main
    process (which collects rollouts between steps): torch.distributed's ``timeout``."""

    def problems(self, *, training: bool = True) -> list[str]:
        """Every bad field, each with the fix, as ``trainer.<field>`` (the YAML key). ``training``
        False (a job that only evaluates with this trainer group, maybe greedily) skips the
        temperature, which only the trainer's logprobs need."""
        return [*self._loss_problems(), *self._compute_problems(training), *self._schedule_problems()]

    def _loss_problems(self) -> list[str]:
        """The loss: its type, normalisation, importance sampling and reward scaling."""
        p: list[str] = []
        if self.loss_type not in LOSS_TYPES:
            p.append(
                f"trainer.loss_type={self.loss_type!r} is not a TRL {TRL_VERSION} GRPO loss type "
                f"({', '.join(LOSS_TYPES)}). Fix: trainer.loss_type=dapo"
            )
        if bad := not_one_of(
            "normalisation", self.normalisation, NORMALISATIONS, "trainer.normalisation=per_token"
        ):
            p += bad
        elif self.loss_type == "vespo" and self.normalisation not in ("per_token", "loss_type"):
            p.append(
                "trainer.loss_type=vespo reads TRL's importance-sampling tensor as a ratio, so only "
                "trainer.normalisation=per_token (or loss_type) is supported with it"
            )
        if self.importance_sampling not in IMPORTANCE_SAMPLING:
            p.append(
                f"trainer.importance_sampling={self.importance_sampling!r} is not one of "
                f"{', '.join(IMPORTANCE_SAMPLING)}. Fix: trainer.importance_sampling=none"
            )
        elif self.importance_sampling != "none" and not self.importance_sampling_clip > 1.0:
            p.append(
                f"trainer.importance_sampling_clip={self.importance_sampling_clip} must be > 1: TIS truncates "
                "the ratio at C, masking keeps [1/C, C]. Fix: trainer.importance_sampling_clip=3.0"
            )
        if self.importance_sampling_level not in ("token", "sequence"):
            p.append(
                f"trainer.importance_sampling_level={self.importance_sampling_level!r} must be token or sequence"
            )
        if self.scale_rewards not in SCALE_REWARDS:
            p.append(f"trainer.scale_rewards must be group, batch or none (got {self.scale_rewards}).")
        return p

    def _compute_problems(self, training: bool) -> list[str]:
        """How the forward passes compute: precision, prefix sharing, temperature, step size, KL."""
        p: list[str] = []
        if bad := not_one_of("dtype", self.dtype, TRAINER_DTYPES):
            p += bad
        elif self.dtype == "float16":
            p.append(
                "trainer.dtype=float16 needs loss scaling, which this trainer does not do (fp16 gradients "
                "underflow). Fix: trainer.dtype=bfloat16 (autocast over float32 weights) or float32"
            )
        if self.prefix_sharing not in PREFIX_SHARING:
            p.append(
                f"trainer.prefix_sharing={self.prefix_sharing!r} is not one of {PREFIX_SHARING}: 'shared' "
                "computes each prefix the rows share once, 'padded' forwards every row alone"
            )
        if training and not self.temperature > 0.0:
            p.append(
                f"trainer.temperature={self.temperature} must be > 0 and equal the engine's sampling "
                "temperature (the trainer divides logits by it)"
            )
        if not self.learning_rate > 0:
            p.append(
                f"trainer.learning_rate must be > 0 (got {self.learning_rate}). Fix: trainer.learning_rate=3e-6"
            )
        if self.beta < 0:
            p.append(f"trainer.beta={self.beta} must be >= 0")
        return p

    def _schedule_problems(self) -> list[str]:
        """Counts and intervals: steps, batches, dynamic sampling, checkpoints and evaluations."""
        p: list[str] = []
        for name in (
            "max_steps",
            "per_device_batch_size",
            "gradient_accumulation_steps",
            "token_budget",
            "weight_sync_interval",
        ):
            if getattr(self, name) < 1:
                p.append(f"trainer.{name} must be >= 1 (got {getattr(self, name)})")
        if self.dynamic_sampling_max_groups is not None and self.dynamic_sampling_max_groups < 1:
            p.append(
                f"trainer.dynamic_sampling_max_groups must be >= 1 or null (got {self.dynamic_sampling_max_groups}). "
                "Fix: trainer.dynamic_sampling_max_groups=null"
            )
        if self.dynamic_sampling_patience is not None and self.dynamic_sampling_patience < 1:
            p.append(
                f"trainer.dynamic_sampling_patience must be >= 1 or null (got {self.dynamic_sampling_patience}). "
                "Fix: trainer.dynamic_sampling_patience=100"
            )
        if self.save_steps < 1 or self.eval_steps < 1:
            p.append("trainer.save_steps and trainer.eval_steps must be >= 1. Fix: trainer.save_steps=50")
        elif self.eval_steps % self.save_steps != 0:
            p.append(
                f"trainer.eval_steps ({self.eval_steps}) must be a multiple of trainer.save_steps "
                f"({self.save_steps}): evaluation runs on saved checkpoints. "
                "Fix: trainer.eval_steps=100 trainer.save_steps=50"
            )
        return p
