"""Reward terms: published values, verification gating, None propagation, refused configurations."""

from __future__ import annotations

import math

import pytest

from fineenvs.rewards import (
    DEFAULT_WEIGHTS,
    REWARD_TERMS,
    RewardConfigError,
    RewardInputs,
    RewardTerm,
    build_reward_weights,
    compute_reward,
    validate_reward_terms,
)


@pytest.mark.parametrize(
    ("tool_calls", "expected"),
    [(0, 1.0), (1, 1.0 + 0.1 * 15 / 16), (15, 1.05), (100, 1.0 + 0.1 * 15 / 115)],
)
def test_correct_verified(tool_calls: int, expected: float) -> None:
    result = compute_reward(1.0, tool_calls, True, DEFAULT_WEIGHTS)
    assert result.reward == pytest.approx(expected, abs=1e-12)
    assert result.terms["correctness"] == 1.0
    assert result.terms["tool_efficiency"] == pytest.approx(expected - 1.0, abs=1e-12)


def test_published_anchor_values() -> None:
    assert compute_reward(1.0, 15, True).reward == pytest.approx(1.05)
    assert compute_reward(1.0, 1, True).reward == pytest.approx(1.09375)
    assert compute_reward(1.0, 100, True).reward == pytest.approx(1.0130434782608695)


@pytest.mark.parametrize("tool_calls", [0, 1, 15, 100, None])
def test_unverified_count_earns_no_bonus(tool_calls: int | None) -> None:
    result = compute_reward(1.0, tool_calls, False, DEFAULT_WEIGHTS)
    assert result.reward == 1.0
    assert result.terms["tool_efficiency"] == 0.0
    if tool_calls:
        assert "not verified" in result.reason


def test_missing_count_even_if_marked_verified_earns_no_bonus() -> None:
    assert compute_reward(1.0, None, True).reward == 1.0


@pytest.mark.parametrize("tool_calls", [0, 1, 15, 100])
@pytest.mark.parametrize("verified", [True, False])
def test_wrong_answer_is_zero(tool_calls: int, verified: bool) -> None:
    result = compute_reward(0.0, tool_calls, verified, DEFAULT_WEIGHTS)
    assert result.reward == 0.0
    assert result.terms == {"correctness": 0.0, "tool_efficiency": 0.0}


@pytest.mark.parametrize("tool_calls", [0, 1, 15, 100, None])
@pytest.mark.parametrize("verified", [True, False])
def test_ungraded_propagates_none(tool_calls: int | None, verified: bool) -> None:
    result = compute_reward(None, tool_calls, verified, DEFAULT_WEIGHTS)
    assert result.reward is None
    assert result.terms == {"correctness": None, "tool_efficiency": None}
    assert "ungraded" in result.reason


def test_correctness_only_spec() -> None:
    spec = build_reward_weights({"correctness": 1.0})
    assert compute_reward(1.0, 3, True, spec).reward == 1.0
    assert compute_reward(1.0, 3, True, spec).terms == {"correctness": 1.0}


def test_custom_budget_and_weight() -> None:
    spec = build_reward_weights({"correctness": 1.0, "tool_efficiency": 0.05}, tool_budget=5)
    assert compute_reward(1.0, 5, True, spec).reward == pytest.approx(1.0 + 0.05 * 5 / 10)


def test_bonus_decreases_with_tool_calls() -> None:
    rewards = [compute_reward(1.0, n, True).reward for n in range(1, 200)]
    assert all(
        a is not None and b is not None and a > b > 1.0 for a, b in zip(rewards, rewards[1:], strict=False)
    )


@pytest.mark.parametrize(("correct", "calls"), [(1.5, 1), (-0.1, 1), (math.nan, 1), (1.0, -1)])
def test_bad_inputs_raise(correct: float, calls: int) -> None:
    with pytest.raises(ValueError):
        compute_reward(correct, calls, True)


def test_default_configuration_is_valid() -> None:
    assert validate_reward_terms({"correctness": 1.0, "tool_efficiency": 0.1}, tool_budget=15) == []


def test_submission_bonus_is_refused_with_the_published_collapse() -> None:
    errors = validate_reward_terms({"correctness": 1.0, "submission": 0.2})
    assert len(errors) == 1
    assert "submission" in errors[0] and "0.740 -> 0.178" in errors[0]


def test_bonus_weight_above_cap_is_refused() -> None:
    errors = validate_reward_terms({"correctness": 1.0, "tool_efficiency": 0.2})
    assert errors and "tool_efficiency=0.2" in errors[0] and "[0, 0.1]" in errors[0]


def test_negative_bonus_and_missing_correctness_are_refused() -> None:
    errors = validate_reward_terms({"tool_efficiency": -0.1})
    assert any("no 'correctness'" in e for e in errors)
    assert any("tool_efficiency=-0.1" in e for e in errors)


@pytest.mark.parametrize("weight", [0.0, -1.0, math.inf, "1"])
def test_bad_correctness_weight(weight: object) -> None:
    assert validate_reward_terms({"correctness": weight})  # type: ignore[dict-item]


@pytest.mark.parametrize("budget", [0, -3, 1.5, True])
def test_bad_tool_budget(budget: object) -> None:
    errors = validate_reward_terms({"correctness": 1.0}, tool_budget=budget)  # type: ignore[arg-type]
    assert any("tool_budget" in e for e in errors)


def test_unknown_term_lists_known_terms() -> None:
    errors = validate_reward_terms({"correctness": 1.0, "speed": 0.1})
    assert errors == [f"reward.terms.speed: unknown term; known terms: {sorted(REWARD_TERMS)}"]


def test_ungated_bonus_is_caught_by_probe_whatever_its_name() -> None:
    def ran_anything(x: RewardInputs) -> float | None:
        return 1.0 if x.tool_calls else 0.0  # pays for activity, not for solving

    registry = dict(REWARD_TERMS, activity=RewardTerm("activity", ran_anything, "bonus", ""))
    errors = validate_reward_terms({"correctness": 1.0, "activity": 0.05}, registry=registry)
    assert len(errors) == 1 and "unsolved attempt" in errors[0] and "0.178" in errors[0]


def test_build_reward_weights_raises_listing_every_problem() -> None:
    with pytest.raises(RewardConfigError) as info:
        build_reward_weights({"submission": 0.2, "tool_efficiency": 0.5})
    text = str(info.value)
    assert "submission" in text and "tool_efficiency=0.5" in text and "no 'correctness'" in text
