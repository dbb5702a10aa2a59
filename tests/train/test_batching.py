"""Normalisation weights and micro-batch tensors (pure, no model)."""

from __future__ import annotations

import pytest
import torch

from fineenvs.train.batching import (
    build_micro_batch,
    plan_micro_batches,
    resolve_normalisation,
    token_weights,
)
from fineenvs.train.train_rows import TrainRow


def mk(
    n_ctx: int, n_train: int, attempt: str, adv: float = 1.0, weight: list[float] | None = None
) -> TrainRow:
    n = n_ctx + n_train
    mask = [0] * n_ctx + [1] * n_train
    return TrainRow(
        input_ids=list(range(10, 10 + n)),
        loss_mask=mask,
        behaviour_logprobs=[-0.5 * m for m in mask],
        advantage=adv,
        attempt_id=attempt,
        group_id="g",
        policy_version=0,
        loss_weight=weight,
    )


def totals(rows: list[TrainRow], weights: list[list[float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for r, w in zip(rows, weights, strict=True):
        out[r.attempt_id] = out.get(r.attempt_id, 0.0) + sum(w)
    return out


def test_per_token_weighs_every_trained_token_the_same() -> None:
    rows = [mk(3, 4, "a"), mk(2, 6, "b"), mk(1, 10, "b")]
    w = token_weights(rows, "per_token")
    flat = [x for ws, r in zip(w, rows, strict=True) for x, m in zip(ws, r.loss_mask, strict=True) if m]
    assert len(flat) == 20 and all(x == pytest.approx(1 / 20) for x in flat)
    assert all(
        x == 0.0 for ws, r in zip(w, rows, strict=True) for x, m in zip(ws, r.loss_mask, strict=True) if not m
    )


def test_per_attempt_weighs_attempts_equally_whatever_their_row_count() -> None:
    rows = [mk(3, 4, "one")] + [mk(2, 5 + i, "four") for i in range(4)]
    w = token_weights(rows, "per_attempt")
    t = totals(rows, w)
    assert t == {"one": pytest.approx(0.5), "four": pytest.approx(0.5)}
    # Within an attempt every trained token weighs the same.
    four = [x for ws, r in zip(w[1:], rows[1:], strict=True) for x in ws if x]
    assert max(four) == pytest.approx(min(four))
    # per_token instead gives the 4-row attempt its token share.
    t_tok = totals(rows, token_weights(rows, "per_token"))
    assert t_tok["four"] == pytest.approx(26 / 30)


def test_loss_weight_scales_and_normalises() -> None:
    rows = [mk(1, 2, "a", weight=[0.0, 1.0, 0.5]), mk(1, 2, "b")]
    w = token_weights(rows, "per_token")
    assert w[0] == pytest.approx([0.0, 1 / 3.5, 0.5 / 3.5])
    assert sum(map(sum, w)) == pytest.approx(1.0)


def test_loss_type_normalisations() -> None:
    assert resolve_normalisation("loss_type", "dapo") == "per_token"
    assert resolve_normalisation("loss_type", "grpo") == "per_row"
    assert resolve_normalisation("per_attempt", "grpo") == "per_attempt"
    rows = [mk(1, 2, "a"), mk(1, 4, "a")]
    assert [sum(x) for x in token_weights(rows, "per_row")] == pytest.approx([0.5, 0.5])
    assert token_weights(rows, "per_row_constant", 8)[1][1] == pytest.approx(1 / 16)
    with pytest.raises(ValueError, match="not one of"):
        resolve_normalisation("per_sequence", "dapo")


def test_micro_batch_split_padding_and_alignment() -> None:
    rows = [mk(3, 2, "a", adv=1.0), mk(5, 4, "b", adv=-2.0), mk(2, 1, "c", adv=0.5)]
    plan = plan_micro_batches(rows, 2)
    assert plan == [[1, 0], [2]]  # longest first
    w = token_weights(rows, "per_token")
    mb = build_micro_batch(rows, plan[0], w, pad_token_id=0)
    # The split is the earliest first-trained index (3), so both prompts have length 3.
    assert mb.prompt_ids.tolist() == [[10, 11, 12], [10, 11, 12]]
    assert mb.completion_ids.tolist() == [[13, 14, 15, 16, 17, 18], [13, 14, 0, 0, 0, 0]]
    assert mb.attention.tolist() == [[1] * 6, [1, 1, 0, 0, 0, 0]]
    assert mb.loss_mask.tolist() == [[0, 0, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]]
    assert mb.behaviour_logps.tolist() == [[0, 0, -0.5, -0.5, -0.5, -0.5], [-0.5, -0.5, 0, 0, 0, 0]]
    assert torch.allclose(mb.weights, mb.loss_mask / 7)
    assert mb.advantages.tolist() == [-2.0, 1.0]
    assert mb.tokens == 14
