"""What the GRPO trainer learns from: token rows stamped with their attempt's advantage.

``TrainRow`` is the trainer's own input type, so the trainer does not depend on how rows are
built. The trajectory package's ``Row`` (``input_ids``, ``loss_mask``, ``logprobs`` aligned to
``input_ids``, optional ``loss_weight``) converts with ``TrainRow.from_row``; the rollout layer
adds the attempt's advantage, ids and the policy version that sampled it.

``group_advantages`` turns one group's rewards into per-attempt advantages (GRPO's group-relative
baseline). It is pure: the caller stamps the result on every row of each attempt.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from fineenvs.trajectory.rows import Row

RewardScale = Literal["group", "batch", "none"]
REWARD_SCALES: tuple[str, ...] = ("group", "batch", "none")
# TRL adds the same epsilon before dividing by the standard deviation.
STD_EPS = 1e-4


@dataclass(frozen=True)
class TrainRow:
    """One training sequence: every per-token list has ``len(input_ids)`` entries.

    ``loss_mask[i] = 1`` marks a token the policy sampled (trained); 0 marks context (prompt, tool
    results, template glue). ``behaviour_logprobs[i]`` is the engine's logprob of ``input_ids[i]``
    given the tokens before it (0.0 where the mask is 0). ``loss_weight`` (optional) scales each
    trained token, e.g. 1/k for a token shared by k rows.
    """

    input_ids: list[int]
    loss_mask: list[int]
    behaviour_logprobs: list[float]
    advantage: float
    attempt_id: str
    group_id: str
    policy_version: int
    loss_weight: list[float] | None = None

    @classmethod
    def from_row(
        cls,
        row: Row,
        *,
        advantage: float,
        attempt_id: str,
        group_id: str,
        policy_version: int,
    ) -> TrainRow:
        """From a trajectory row (``fineenvs.trajectory.rows.Row``)."""
        weight = row.loss_weight
        return cls(
            input_ids=list(row.input_ids),
            loss_mask=list(row.loss_mask),
            behaviour_logprobs=list(row.logprobs),
            advantage=float(advantage),
            attempt_id=attempt_id,
            group_id=group_id,
            policy_version=int(policy_version),
            loss_weight=None if weight is None else list(weight),
        )

    @property
    def first_trained(self) -> int:
        """Index of the first trained token (the prompt is everything before it)."""
        return self.loss_mask.index(1)

    def weights(self) -> list[float]:
        """Per-token loss weight: ``loss_weight`` where given, else 1.0, always 0 where mask is 0."""
        if self.loss_weight is None:
            return [float(m) for m in self.loss_mask]
        return [w if m else 0.0 for w, m in zip(self.loss_weight, self.loss_mask, strict=True)]

    def check(self, where: str = "row") -> None:
        """Raise ``ValueError`` saying what is wrong with this row and how to fix it."""
        n = len(self.input_ids)
        where = f"{where} (attempt {self.attempt_id!r}, group {self.group_id!r})"
        lengths = {"loss_mask": len(self.loss_mask), "behaviour_logprobs": len(self.behaviour_logprobs)}
        if self.loss_weight is not None:
            lengths["loss_weight"] = len(self.loss_weight)
        bad = {k: v for k, v in lengths.items() if v != n}
        if bad:
            raise ValueError(
                f"{where}: per-token lists must have len(input_ids)={n} entries, got {bad}. Build rows "
                "with logprobs and masks aligned to input_ids (0.0 / 0 on context tokens)."
            )
        if n < 2:
            raise ValueError(f"{where}: a row needs at least 2 tokens (a context token, then a trained one)")
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError(f"{where}: loss_mask must hold only 0 and 1, got {sorted(set(self.loss_mask))}")
        if 1 not in self.loss_mask:
            raise ValueError(
                f"{where}: no trained token (loss_mask is all 0). Leave rows without sampled tokens out "
                "before training (trajectory rows marked trainable=False)."
            )
        if self.loss_mask[0] == 1:
            raise ValueError(
                f"{where}: the first token is marked trained, but nothing precedes it to predict it from. "
                "A row starts with its prompt (mask 0)."
            )
        for i, (m, lp) in enumerate(zip(self.loss_mask, self.behaviour_logprobs, strict=True)):
            if m and not (math.isfinite(lp) and lp <= 0.0):
                raise ValueError(
                    f"{where}: behaviour logprob at token {i} is {lp}, but a trained token needs a finite "
                    "logprob <= 0 from the engine. Mask the call (context only) when its logprobs are missing."
                )
        if not math.isfinite(self.advantage):
            raise ValueError(f"{where}: advantage is {self.advantage}; it must be finite")
        if self.loss_weight is not None and any(
            not (w >= 0.0 and math.isfinite(w)) for w in self.loss_weight
        ):
            raise ValueError(f"{where}: loss_weight must be finite and >= 0")
        if self.loss_weight is not None and sum(self.weights()) <= 0.0:
            raise ValueError(f"{where}: every trained token has loss_weight 0; leave the row out instead")


def group_advantages(
    rewards: Sequence[float | None], scale: str = "group", *, batch_std: float | None = None
) -> list[float | None]:
    """Advantages for one group's attempts: reward minus the group mean over graded attempts.

    ``None`` rewards (crashed, timed out, ungradable attempts) are excluded from the baseline and
    get ``None``. A group with fewer than two graded attempts gives no signal: every entry is
    ``None``. ``scale`` follows TRL's ``scale_rewards``: ``"group"`` divides by the group's
    standard deviation (+1e-4), ``"batch"`` by ``batch_std`` (+1e-4; the std of every graded reward
    of the step's groups, ``reward_std``), ``"none"`` leaves the centred reward as is (Dr. GRPO).
    """
    if scale not in REWARD_SCALES:
        raise ValueError(f"scale={scale!r} is not one of {REWARD_SCALES} (TRL's scale_rewards options)")
    graded = [r for r in rewards if r is not None]
    for r in graded:
        if not math.isfinite(r):
            raise ValueError(f"reward {r} is not finite; an attempt that could not be graded has reward None")
    if len(graded) < 2:
        return [None] * len(rewards)
    mean = sum(graded) / len(graded)
    divisor = 1.0
    if scale == "group":
        divisor = reward_std(graded) + STD_EPS
    elif scale == "batch":
        if batch_std is None:
            raise ValueError(
                "scale='batch' divides by the std of all rewards of the step: pass "
                "batch_std=reward_std(<every graded reward of the step's groups>)"
            )
        divisor = batch_std + STD_EPS
    return [None if r is None else (r - mean) / divisor for r in rewards]


def reward_std(rewards: Sequence[float | None]) -> float:
    """Unbiased standard deviation (TRL's ``nanstd``) of the graded rewards; 0.0 for fewer than 2."""
    graded = [r for r in rewards if r is not None]
    if len(graded) < 2:
        return 0.0
    return _std(graded)


def _std(values: Sequence[float]) -> float:
    # TRL uses torch.std, the unbiased (n - 1) estimator.
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
