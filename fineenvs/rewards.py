"""Reward terms and shaping: named, pure, each value logged; ``None`` means "no grade", never 0.

The published recipe (defaults here)::

    reward = correct * (1 + bonus)
    bonus  = correct * w * B / (B + tool_calls)   if tool_calls > 0 and the count is verified
           = 0                                    otherwise            (w = 0.1, B = 15)

so a correct answer with 15 verified tool calls earns 1.05, with 1 call 1.09375, with 100 calls
1.0130..., and an unverified count earns exactly 1.0. ``correct`` is 1.0/0.0 from the grader or
``None`` when the attempt was never graded; ``None`` propagates to the reward (the scheduler leaves
such attempts out of the group's baseline) instead of becoming a silent 0.

Configuration is a dict of term name -> weight (Hydra: ``reward: {terms: {correctness: 1.0,
tool_efficiency: 0.1}, tool_budget: 15}``), checked by `validate_reward_terms`. A term is only
allowed if it pays nothing when the task is not solved. Why: a published run added "+0.2 for
submitting anything"; the policy learned to submit at once, training reward looked healthy, and
held-out accuracy fell from 0.740 to 0.178.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

DEFAULT_TOOL_BUDGET = 15
MAX_BONUS_WEIGHT = 0.1
SUBMISSION_COLLAPSE = (
    "a published run rewarded '+0.2 for submitting' and collapsed: the policy learned to submit "
    "without solving, held-out accuracy fell 0.740 -> 0.178 while training reward looked healthy"
)


@dataclass(frozen=True)
class RewardInputs:
    """What every term sees about one finished attempt."""

    correct: float | None  # grader score, None = ungraded
    tool_calls: int | None  # native tool actions from the harness's own trajectory
    tool_calls_verified: bool  # the count came from trustworthy evidence (e.g. ATIF)
    tool_budget: int = DEFAULT_TOOL_BUDGET


TermFn = Callable[[RewardInputs], float | None]


@dataclass(frozen=True)
class RewardTerm:
    """A named term. `kind="base"` terms add up; `kind="bonus"` terms multiply in as (1 + w * term)."""

    name: str
    fn: TermFn
    kind: str
    doc: str


def correctness(x: RewardInputs) -> float | None:
    """The grader's 1.0/0.0, or None when ungraded."""
    return x.correct


def tool_efficiency(x: RewardInputs) -> float | None:
    """correct * B / (B + tool_calls) for a verified count > 0; 0 otherwise; None when ungraded."""
    if x.correct is None:
        return None
    if not x.tool_calls_verified or x.tool_calls is None or x.tool_calls <= 0:
        return 0.0  # no evidence (or nothing done) earns no bonus
    return x.correct * x.tool_budget / (x.tool_budget + x.tool_calls)


REWARD_TERMS: dict[str, RewardTerm] = {
    "correctness": RewardTerm("correctness", correctness, "base", correctness.__doc__ or ""),
    "tool_efficiency": RewardTerm("tool_efficiency", tool_efficiency, "bonus", tool_efficiency.__doc__ or ""),
}

# Names people reach for that pay without solving the task; refused with the reason.
REFUSED_TERMS: dict[str, str] = {
    name: f"'{name}' pays an agent that has not solved the task; {SUBMISSION_COLLAPSE}"
    for name in ("submission", "submitted", "submit", "answer_written", "format", "ran", "participation")
}


@dataclass(frozen=True)
class RewardWeights:
    """The reward's terms and their weights, and the tool budget, validated (`build_reward_weights`);
    the run config's `reward:` section (`config.RewardSpec`) is what it is built from."""

    terms: dict[str, float]
    tool_budget: int = DEFAULT_TOOL_BUDGET
    registry: Mapping[str, RewardTerm] = field(default_factory=lambda: REWARD_TERMS, repr=False)


@dataclass(frozen=True)
class RewardResult:
    """The scalar reward (None = ungraded) and every term's value, for logging as reward/<term>."""

    reward: float | None
    terms: dict[str, float | None]
    reason: str = ""


class RewardConfigError(ValueError):
    """The reward configuration would teach the wrong thing; the message lists every problem."""


def validate_reward_terms(
    terms: Mapping[str, float],
    *,
    tool_budget: int = DEFAULT_TOOL_BUDGET,
    registry: Mapping[str, RewardTerm] = REWARD_TERMS,
) -> list[str]:
    """Every problem with a term -> weight configuration, as sentences (empty list = valid).

    Besides names and weights, each configured term is probed: evaluated on unsolved attempts
    (correct = 0) across tool-call counts, it must pay exactly 0. That catches any term that can
    be earned without solving the task, whatever it is called.
    """
    errors: list[str] = []
    fix = "e.g. reward.terms={correctness: 1.0, tool_efficiency: 0.1}"
    if isinstance(tool_budget, bool) or not isinstance(tool_budget, int) or tool_budget <= 0:
        errors.append(f"reward.tool_budget={tool_budget!r} must be a positive integer (published: 15)")
        tool_budget = DEFAULT_TOOL_BUDGET
    if "correctness" not in terms:
        errors.append(
            f"reward.terms has no 'correctness': the reward must depend on solving the task ({fix})"
        )
    for name, weight in terms.items():
        if name in REFUSED_TERMS and name not in registry:
            errors.append(f"reward.terms.{name}: refused: {REFUSED_TERMS[name]}")
            continue
        if name not in registry:
            errors.append(f"reward.terms.{name}: unknown term; known terms: {sorted(registry)}")
            continue
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
            errors.append(f"reward.terms.{name}={weight!r} must be a finite number")
            continue
        term = registry[name]
        if term.kind == "base" and weight <= 0:
            errors.append(
                f"reward.terms.{name}={weight} must be > 0 (a non-positive base term rewards failing)"
            )
        if term.kind == "bonus" and not 0 <= weight <= MAX_BONUS_WEIGHT:
            errors.append(
                f"reward.terms.{name}={weight} must be in [0, {MAX_BONUS_WEIGHT}]: a larger bonus lets "
                "efficiency compete with correctness, a negative one rewards extra tool calls "
                f"(published: {MAX_BONUS_WEIGHT})"
            )
        leak = _pays_without_solving(term, tool_budget)
        if leak is not None:
            errors.append(f"reward.terms.{name}: pays {leak} on an unsolved attempt; {SUBMISSION_COLLAPSE}")
    return errors


def build_reward_weights(
    terms: Mapping[str, float],
    *,
    tool_budget: int = DEFAULT_TOOL_BUDGET,
    registry: Mapping[str, RewardTerm] = REWARD_TERMS,
) -> RewardWeights:
    """Validate and freeze a configuration; raises `RewardConfigError` listing every problem."""
    errors = validate_reward_terms(terms, tool_budget=tool_budget, registry=registry)
    if errors:
        raise RewardConfigError("invalid reward configuration:\n  - " + "\n  - ".join(errors))
    return RewardWeights(
        terms={k: float(v) for k, v in terms.items()}, tool_budget=tool_budget, registry=registry
    )


DEFAULT_WEIGHTS = RewardWeights(terms={"correctness": 1.0, "tool_efficiency": 0.1})


def compute_reward(
    correct: float | None,
    tool_calls: int | None,
    tool_calls_verified: bool,
    spec: RewardWeights = DEFAULT_WEIGHTS,
) -> RewardResult:
    """reward = (sum of weighted base terms) * (1 + sum of weighted bonus terms).

    `terms` in the result holds each term's weighted contribution: the base value(s) and the bonus.
    With the default spec that is exactly ``correct * (1 + 0.1 * 15 / (15 + tool_calls))``.
    """
    if correct is not None and (not math.isfinite(correct) or not 0.0 <= correct <= 1.0):
        raise ValueError(f"correct={correct!r} must be in [0, 1] or None (ungraded)")
    if tool_calls is not None and tool_calls < 0:
        raise ValueError(f"tool_calls={tool_calls} must be >= 0 or None (unknown)")
    inputs = RewardInputs(correct, tool_calls, tool_calls_verified, spec.tool_budget)
    values: dict[str, float | None] = {}
    for name, weight in spec.terms.items():
        value = spec.registry[name].fn(inputs)
        values[name] = None if value is None else weight * value
    if correct is None or any(v is None for v in values.values()):
        return RewardResult(None, {k: None for k in values}, "ungraded: excluded from the group baseline")
    base = sum(v for k, v in values.items() if v is not None and spec.registry[k].kind == "base")
    bonus = sum(v for k, v in values.items() if v is not None and spec.registry[k].kind == "bonus")
    reason = ""
    if "tool_efficiency" in values and correct and tool_calls and not tool_calls_verified:
        reason = "tool-call count not verified: no efficiency bonus"
    return RewardResult(base * (1.0 + bonus), values, reason)


def _pays_without_solving(term: RewardTerm, tool_budget: int) -> float | None:
    for calls in (None, 0, 1, 5, tool_budget, 100, 10_000):
        for verified in (True, False):
            value = term.fn(RewardInputs(0.0, calls, verified, tool_budget))
            if value not in (0.0, None):
                return value
    return None
