"""Rows to micro-batches, and the per-token loss weights that make the loss split-invariant.

Normalisation (``normalisation``) is decided over the whole optimizer step, before the rows are
split into micro-batches: each trained token gets a weight ``w_t`` and the step's loss is
``sum_t w_t * l_t`` over every micro-batch. Summing per-micro-batch sums is exact, so the loss and
its gradient do not depend on the split (the mean-of-micro-batch-means bug of TRL #7249 cannot
happen). ``lw_t`` is the row's ``loss_weight`` (1.0 when absent):

- ``per_token`` (published; TRL's ``dapo``/``bnpo`` over the whole step):
  ``w_t = lw_t / sum(lw)``: every trained token of the step weighs the same.
- ``per_attempt``: ``w_t = lw_t / (A * sum_{t' in a} lw_t')``: each of the ``A`` attempts weighs
  ``1/A`` however many rows or tokens it produced (an 8-row Claude Code attempt does not dominate).
- ``per_row`` (TRL's ``grpo``/``sapo``: mean over each sequence, then over sequences):
  ``w_t = lw_t / (R * sum_{t' in r} lw_t')``.
- ``loss_type``: the normalisation TRL's ``loss_type`` implies, computed over the whole step:
  ``dapo``/``bnpo``/``cispo``/``vespo`` -> ``per_token``, ``grpo``/``sapo`` -> ``per_row``,
  ``dr_grpo`` -> ``lw_t / (R * max_completion_length)``, ``luspo`` -> ``lw_t / R``.

Padding: each micro-batch is right-padded with an attention mask, never packed. Packing several
rows into one sequence would let LFM2's short convolutions and Qwen3.5's linear-attention scan
run across row boundaries unless ``seq_idx`` is threaded through (published-system P4); right
padding leaves every real token's causal context exactly as in an unpadded forward. The prompt /
completion split of a micro-batch is the earliest first-trained index among its rows, so all
prompts have one length (no left padding, no shifted positions) and logits are only projected
for the completion part.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fineenvs.train.grpo_config import NORMALISATIONS
from fineenvs.train.train_rows import TrainRow

LOSS_TYPE_NORMALISATION = {
    "dapo": "per_token",
    "bnpo": "per_token",
    "cispo": "per_token",
    "vespo": "per_token",
    "grpo": "per_row",
    "sapo": "per_row",
    "dr_grpo": "per_row_constant",
    "luspo": "per_row_sum",
}


def resolve_normalisation(normalisation: str, loss_type: str) -> str:
    """The concrete rule: one of per_token, per_attempt, per_row, per_row_constant, per_row_sum."""
    if normalisation not in NORMALISATIONS:
        raise ValueError(
            f"normalisation={normalisation!r} is not one of {NORMALISATIONS}; see fineenvs.train.batching"
        )
    if normalisation != "loss_type":
        return normalisation
    if loss_type not in LOSS_TYPE_NORMALISATION:
        raise ValueError(
            f"loss_type={loss_type!r} has no known normalisation; known: {sorted(LOSS_TYPE_NORMALISATION)}"
        )
    return LOSS_TYPE_NORMALISATION[loss_type]


def token_weights(rows: Sequence[TrainRow], rule: str, max_completion_length: int = 0) -> list[list[float]]:
    """Per-token loss weights (0 on context tokens) for every row of one optimizer step."""
    base = [r.weights() for r in rows]
    if rule == "per_token":
        total = sum(sum(w) for w in base)
        return [[x / total for x in w] for w in base]
    if rule == "per_attempt":
        per_attempt: dict[str, float] = defaultdict(float)
        for r, w in zip(rows, base, strict=True):
            per_attempt[r.attempt_id] += sum(w)
        n = len(per_attempt)
        return [[x / (n * per_attempt[r.attempt_id]) for x in w] for r, w in zip(rows, base, strict=True)]
    if rule == "per_row":
        return [[x / (len(rows) * sum(w)) for x in w] for w in base]
    if rule == "per_row_constant":
        if max_completion_length <= 0:
            raise ValueError("dr_grpo normalisation divides by max_completion_length, which must be > 0")
        return [[x / (len(rows) * max_completion_length) for x in w] for w in base]
    if rule == "per_row_sum":
        return [[x / len(rows) for x in w] for w in base]
    raise ValueError(f"unknown normalisation rule {rule!r}")


@dataclass
class MicroBatch:
    """Tensors of one forward pass; ``C`` is the padded completion length."""

    row_indices: list[int]
    prompt_ids: torch.Tensor  # (B, P), every row's first P tokens (all context)
    completion_ids: torch.Tensor  # (B, C), right-padded
    attention: torch.Tensor  # (B, C) 1 on real tokens (context or trained), 0 on padding
    loss_mask: torch.Tensor  # (B, C) 1 on trained tokens
    weights: torch.Tensor  # (B, C) normalisation weight x loss_weight; 0 off the loss mask
    behaviour_logps: torch.Tensor  # (B, C) engine logprobs; 0 off the loss mask
    advantages: torch.Tensor  # (B,)
    tokens: int  # real tokens in the micro-batch

    @property
    def size(self) -> int:
        return len(self.row_indices)


def plan_micro_batches(rows: Sequence[TrainRow], micro_batch_size: int) -> list[list[int]]:
    """Row indices per micro-batch: longest rows first, so rows of similar length share padding."""
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i].input_ids))
    return [order[i : i + micro_batch_size] for i in range(0, len(order), micro_batch_size)]


def build_micro_batch(
    rows: Sequence[TrainRow],
    indices: Sequence[int],
    weights: Sequence[Sequence[float]],
    pad_token_id: int,
    device: torch.device | str = "cpu",
) -> MicroBatch:
    chosen = [rows[i] for i in indices]
    split = min(r.first_trained for r in chosen)
    width = max(len(r.input_ids) for r in chosen) - split
    b = len(chosen)
    prompt = torch.tensor([r.input_ids[:split] for r in chosen], dtype=torch.long)
    completion = torch.full((b, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((b, width), dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.float32)
    w = torch.zeros((b, width), dtype=torch.float32)
    old = torch.zeros((b, width), dtype=torch.float32)
    for j, (i, r) in enumerate(zip(indices, chosen, strict=True)):
        n = len(r.input_ids) - split
        completion[j, :n] = torch.tensor(r.input_ids[split:], dtype=torch.long)
        attention[j, :n] = 1
        mask[j, :n] = torch.tensor(r.loss_mask[split:], dtype=torch.float32)
        w[j, :n] = torch.tensor(weights[i][split:], dtype=torch.float32)
        old[j, :n] = torch.tensor(r.behaviour_logprobs[split:], dtype=torch.float32)
    old = old * mask  # context tokens carry no behaviour logprob
    return MicroBatch(
        row_indices=list(indices),
        prompt_ids=prompt.to(device),
        completion_ids=completion.to(device),
        attention=attention.to(device),
        loss_mask=mask.to(device),
        weights=w.to(device),
        behaviour_logps=old.to(device),
        advantages=torch.tensor([r.advantage for r in chosen], dtype=torch.float32, device=device),
        tokens=sum(len(r.input_ids) for r in chosen),
    )
