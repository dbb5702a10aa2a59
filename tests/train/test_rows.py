"""TrainRow validation and group-relative advantages (pure, no model)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from fineenvs.train.train_rows import TrainRow, group_advantages, reward_std


def row(**kw: object) -> TrainRow:
    base: dict[str, object] = dict(
        input_ids=[5, 6, 7, 8],
        loss_mask=[0, 0, 1, 1],
        behaviour_logprobs=[0.0, 0.0, -0.5, -1.5],
        advantage=1.0,
        attempt_id="a",
        group_id="g",
        policy_version=0,
    )
    base.update(kw)
    return TrainRow(**base)  # type: ignore[arg-type]


def test_group_advantages_centre_on_graded_mean_and_skip_none() -> None:
    adv = group_advantages([1.0, None, 0.0, 0.0, 1.0], scale="none")
    assert adv == [0.5, None, -0.5, -0.5, 0.5]


def test_group_scale_divides_by_unbiased_std() -> None:
    rewards = [1.0, 0.0, 0.0, 0.0]
    std = math.sqrt(sum((r - 0.25) ** 2 for r in rewards) / 3)
    adv = group_advantages(rewards, scale="group")
    assert adv[0] == pytest.approx(0.75 / (std + 1e-4))
    assert adv[1] == pytest.approx(-0.25 / (std + 1e-4))
    assert sum(a for a in adv if a is not None) == pytest.approx(0.0, abs=1e-12)


def test_fewer_than_two_graded_attempts_give_no_signal() -> None:
    assert group_advantages([None, 1.0, None], scale="group") == [None, None, None]
    assert group_advantages([None, None], scale="none") == [None, None]
    assert group_advantages([], scale="none") == []


def test_identical_rewards_give_zero_advantage() -> None:
    assert group_advantages([1.0, 1.0, 1.0], scale="group") == [0.0, 0.0, 0.0]


def test_batch_scale_needs_the_batch_std() -> None:
    with pytest.raises(ValueError, match="batch_std"):
        group_advantages([1.0, 0.0], scale="batch")
    batch = [1.0, 0.0, 1.0, 1.0, None]
    std = reward_std(batch)
    adv = group_advantages([1.0, 0.0], scale="batch", batch_std=std)
    assert adv == [pytest.approx(0.5 / (std + 1e-4)), pytest.approx(-0.5 / (std + 1e-4))]
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages([1.0, 0.0], scale="std")
    with pytest.raises(ValueError, match="None"):
        group_advantages([1.0, math.nan], scale="none")


def test_row_checks_say_what_is_wrong() -> None:
    row().check()
    with pytest.raises(ValueError, match="len\\(input_ids\\)=4"):
        row(loss_mask=[0, 1, 1]).check()
    with pytest.raises(ValueError, match="no trained token"):
        row(loss_mask=[0, 0, 0, 0]).check()
    with pytest.raises(ValueError, match="first token"):
        row(loss_mask=[1, 0, 1, 1]).check()
    with pytest.raises(ValueError, match="logprob at token 3"):
        row(behaviour_logprobs=[0.0, 0.0, -0.5, 0.3]).check()
    with pytest.raises(ValueError, match="logprob at token 2"):
        row(behaviour_logprobs=[0.0, 0.0, math.nan, -1.0]).check()
    with pytest.raises(ValueError, match="advantage"):
        row(advantage=math.inf).check()
    with pytest.raises(ValueError, match="loss_weight"):
        row(loss_weight=[0.0, 0.0, -1.0, 1.0]).check()


def test_weights_zero_on_context_and_follow_loss_weight() -> None:
    assert row().weights() == [0.0, 0.0, 1.0, 1.0]
    assert row(loss_weight=[9.0, 9.0, 0.5, 0.25]).weights() == [0.0, 0.0, 0.5, 0.25]
    assert row().first_trained == 2


def test_from_trajectory_row() -> None:
    @dataclass
    class Row:  # the fields fineenvs.trajectory.rows.Row carries
        input_ids: list[int]
        loss_mask: list[int]
        logprobs: list[float]
        loss_weight: list[float] | None = None

    r = TrainRow.from_row(
        Row([1, 2, 3], [0, 1, 1], [0.0, -0.1, -0.2]),
        advantage=0.5,
        attempt_id="x",
        group_id="g",
        policy_version=3,
    )
    assert r.input_ids == [1, 2, 3] and r.behaviour_logprobs == [0.0, -0.1, -0.2]
    assert (r.advantage, r.attempt_id, r.policy_version, r.loss_weight) == (0.5, "x", 3, None)


def test_from_the_trajectory_packages_row() -> None:
    from fineenvs.trajectory.rows import Row

    src = Row(
        row_id="r0",
        input_ids=[1, 2, 3, 4],
        loss_mask=[0, 1, 0, 1],
        logprobs=[0.0, -0.3, 0.0, -0.7],
        turn_starts=[1, 3],
        turn_ends=[2, 4],
        node_ids=["n0", "n1"],
        role="agent",
        trainable=True,
        prompt_len=1,
        loss_weight=[0.0, 0.5, 0.0, 1.0],
    )
    r = TrainRow.from_row(src, advantage=-1.0, attempt_id="a", group_id="g", policy_version=2)
    r.check()
    assert r.weights() == [0.0, 0.5, 0.0, 1.0] and r.behaviour_logprobs == [0.0, -0.3, 0.0, -0.7]
