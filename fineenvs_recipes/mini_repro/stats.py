"""The mini-reproduction's statistics beyond pass@1: tool calls on co-solved cells with a paired
bootstrap interval, the two-sided sign test, and the issue's targets (1)-(6) for one run.

Pure functions of the evaluation's deciding attempts (``fineenvs.results.deciding_attempts``), keyed
by the recipe's stage names, so the report and its tests share them.

The tests, and why each:

- pass@1 differences between two checkpoints are paired on the same (task, harness) cells: the
  exact sign test (McNemar) on the cells one solved and the other did not, **one-sided** where the
  paper states a direction (RL lifts, SFT ends below RL), **two-sided** where it does not (which
  harness is better for the same weights; whether RL transfers to an unseen harness).
- tool calls are compared on co-solved cells (both checkpoints solved them: an unsolved attempt's
  call count says nothing about efficiency). The figure is the ratio of the mean calls, ``mean(a) /
  mean(b) - 1`` (-0.2: ``a`` used 20 % fewer), and its 95 % interval a percentile bootstrap over
  co-solved cells, resampled as pairs (so the tasks' own call counts cancel), ``BOOTSTRAP_RESAMPLES``
  resamples from a fixed seed: the same records give the same interval. Cells where both used the
  same number of calls are kept: they are part of the mean.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fineenvs.results import EvalAttempt, co_solved_cells, sign_test_p, wilson, won_lost

Cell = tuple[str, str]  # (task id, harness)
Finals = Mapping[Cell, EvalAttempt]

BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
ALPHA = 0.05
BONUS_TARGET = 0.20
"""Target (5): RL with the bonus uses at least this fraction fewer tool calls on co-solved cells
than RL without it."""


def two_sided_sign_p(won: int, lost: int) -> float:
    """Two-sided exact sign test: twice the smaller tail, at most 1."""
    return min(1.0, 2 * min(sign_test_p(won, lost), sign_test_p(lost, won)))


def co_solved_calls(a: Finals, b: Finals, harnesses: Sequence[str]) -> list[tuple[float, float]]:
    """(calls of ``a``, calls of ``b``) on every cell of ``harnesses`` both solved with a tool count,
    in cell order."""
    keys = [k for k in co_solved_cells(a, b) if k[1] in harnesses]
    return [(float(a[k].tool_calls or 0), float(b[k].tool_calls or 0)) for k in keys]


@dataclass
class CallRatio:
    """Tool calls of ``a`` against ``b`` on their co-solved cells."""

    cells: int
    mean_a: float | None
    mean_b: float | None
    change: float | None
    """``mean_a / mean_b - 1``: -0.2 means ``a`` used 20 % fewer calls."""
    low: float | None
    high: float | None
    """The 95 % percentile-bootstrap interval of ``change``."""
    fewer: int = 0
    """Cells where ``a`` used fewer calls than ``b``; ``more`` the reverse."""
    more: int = 0


def call_ratio(
    pairs: Sequence[tuple[float, float]], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED
) -> CallRatio:
    """The change in mean tool calls on co-solved cells, with its paired bootstrap interval (module
    docstring). A resample whose ``b`` calls sum to 0 has no ratio and is left out."""
    n = len(pairs)
    fewer = sum(1 for x, y in pairs if x < y)
    more = sum(1 for x, y in pairs if x > y)
    if not n:
        return CallRatio(0, None, None, None, None, None, fewer, more)
    sa, sb = sum(x for x, _ in pairs), sum(y for _, y in pairs)
    if sb == 0:
        return CallRatio(n, sa / n, 0.0, None, None, None, fewer, more)
    rng = random.Random(seed)
    changes = []
    for _ in range(resamples):
        drawn = [pairs[rng.randrange(n)] for _ in range(n)]
        den = sum(y for _, y in drawn)
        if den:
            changes.append(sum(x for x, _ in drawn) / den - 1.0)
    changes.sort()
    low, high = _percentile(changes, 0.025), _percentile(changes, 0.975)
    return CallRatio(n, sa / n, sb / n, sa / sb - 1.0, low, high, fewer, more)


def _percentile(sorted_values: Sequence[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[round(q * (len(sorted_values) - 1))]


def format_change(r: CallRatio) -> str:
    """``23 cells: 1.35 → 1.17, -13 % [-20, -5]``."""
    if r.change is None:
        return f"{r.cells} cells" + ("" if not r.cells else f": {r.mean_a:.2f} vs {r.mean_b:.2f}")
    return (
        f"{r.cells} cells: {r.mean_b:.2f} → {r.mean_a:.2f}, {r.change * 100:+.0f} % "
        f"[{(r.low or 0) * 100:+.0f}, {(r.high or 0) * 100:+.0f}]"
    )


# --------------------------------------------------------------------------- targets


@dataclass
class Target:
    """One of the issue's targets for a single run."""

    number: int
    what: str
    figure: str
    test: str
    status: str
    """``reached``, ``missed``, ``measured`` (target 6: reported, not a pass/fail), or ``not measured``
    (a stage it needs did not run)."""
    details: dict[str, Any] = field(default_factory=dict)


def solved_count(finals: Finals, task_ids: Sequence[str], h: str) -> int:
    """Cells of harness ``h`` over ``task_ids`` whose deciding attempt solved the task."""
    return sum(1 for t in task_ids if _solved(finals, t, h))


def _rate(finals: Finals, task_ids: Sequence[str], h: str) -> tuple[int, float]:
    solved = solved_count(finals, task_ids, h)
    return solved, solved / len(task_ids) if task_ids else 0.0


def _p(p: float) -> str:
    return f"{p:.2g}"


def targets(
    finals: Mapping[str, Finals],
    task_ids: Sequence[str],
    mix: Sequence[str],
    unseen: Sequence[str],
    rl_one_harness: str,
) -> list[Target]:
    """The issue's targets (1)-(6) for one run, from the deciding attempts by stage name; never
    tuned to pass: each has its test and threshold fixed here."""
    out: list[Target] = []
    n = len(task_ids)
    base = finals.get("base")

    def missing(number: int, what: str, test: str, stages: Sequence[str]) -> Target:
        absent = [s for s in stages if s not in finals]
        return Target(number, what, "-", test, "not measured", {"missing": absent})

    # (1) harness sensitivity: the same weights, the highest and lowest harness of the mix.
    what1 = "harness sensitivity: the base's pass@1 differs between harnesses"
    test1 = (
        "base, best vs worst harness of the mix on the same tasks: two-sided exact sign test, "
        "Bonferroni-corrected for the number of harness pairs; p < 0.05"
    )
    if base is None or len(mix) < 2:
        out.append(missing(1, what1, test1, ["base"]))
    else:
        rates = {h: _rate(base, task_ids, h) for h in mix}
        hi = max(mix, key=lambda h: rates[h][0])
        lo = min(mix, key=lambda h: rates[h][0])
        # Per task: solved in hi and not lo (won) against the reverse.
        won = sum(1 for t in task_ids if _solved(base, t, hi) and not _solved(base, t, lo))
        lost = sum(1 for t in task_ids if _solved(base, t, lo) and not _solved(base, t, hi))
        pairs = len(mix) * (len(mix) - 1) // 2
        p = min(1.0, two_sided_sign_p(won, lost) * pairs)
        wl, wh = wilson(rates[lo][0], n), wilson(rates[hi][0], n)
        disjoint = wl[1] < wh[0]
        out.append(
            Target(
                1,
                what1,
                f"{hi} {rates[hi][1]:.2f} [{wh[0]:.2f}, {wh[1]:.2f}] vs {lo} {rates[lo][1]:.2f} "
                f"[{wl[0]:.2f}, {wl[1]:.2f}]; {won} / {lost} tasks, p = {_p(p)} (×{pairs} pairs); Wilson "
                f"intervals {'disjoint' if disjoint else 'overlap'}",
                test1,
                "reached" if p < ALPHA else "missed",
                {"won": won, "lost": lost, "p": p, "disjoint": disjoint},
            )
        )

    # (2) RL in one harness lifts that harness, more than the others.
    what2 = f"RL in one harness ({rl_one_harness}) lifts it, p < 0.05, and more than the harnesses it did not train in"
    test2 = (
        f"rl_one vs base in {rl_one_harness}: one-sided exact sign test, p < 0.05; and its gain in pass@1 "
        "there above its gain in every other harness of the mix (direction, no test)"
    )
    if base is None or "rl_one" not in finals:
        out.append(missing(2, what2, test2, ["base", "rl_one"]))
    else:
        gains = {}
        for h in mix:
            w, lo_ = won_lost(base, finals["rl_one"], task_ids, [h])
            gains[h] = (w, lo_, (w - lo_) / n if n else 0.0)
        w, lo_, g = gains[rl_one_harness]
        p = sign_test_p(w, lo_)
        others = {h: v for h, v in gains.items() if h != rl_one_harness}
        more = all(g > v[2] for v in others.values())
        out.append(
            Target(
                2,
                what2,
                f"{rl_one_harness} {w} / {lo_}, p = {_p(p)}, {g:+.2f}; "
                + ", ".join(f"{h} {v[0]} / {v[1]}, {v[2]:+.2f}" for h, v in others.items()),
                test2,
                "reached" if p < ALPHA and more else "missed",
                {"p": p, "gain": g, "other_gains": {h: v[2] for h, v in others.items()}},
            )
        )

    # (3) RL across the mix lifts pass@1 overall and every harness of the mix in direction.
    what3 = "RL across the mix lifts pass@1 overall, p < 0.05, and every harness of the mix in direction"
    test3 = "rl_mix vs base on every cell of the mix: one-sided exact sign test, p < 0.05; won > lost in each harness"
    if base is None or "rl_mix" not in finals:
        out.append(missing(3, what3, test3, ["base", "rl_mix"]))
    else:
        w, lo_ = won_lost(base, finals["rl_mix"], task_ids, mix)
        p = sign_test_p(w, lo_)
        each = {h: won_lost(base, finals["rl_mix"], task_ids, [h]) for h in mix}
        every = all(a > b for a, b in each.values())
        out.append(
            Target(
                3,
                what3,
                f"{w} / {lo_}, p = {_p(p)}; " + ", ".join(f"{h} {a} / {b}" for h, (a, b) in each.items()),
                test3,
                "reached" if p < ALPHA and every else "missed",
                {"p": p, "every_harness": every},
            )
        )

    # (4) SFT on the mix ends below RL across the mix.
    what4 = "SFT on the mix ends below RL across the mix, p < 0.05"
    test4 = "rl_mix vs sft_mix on every cell of the mix: one-sided exact sign test, p < 0.05"
    if "sft_mix" not in finals or "rl_mix" not in finals:
        out.append(missing(4, what4, test4, ["sft_mix", "rl_mix"]))
    else:
        w, lo_ = won_lost(finals["sft_mix"], finals["rl_mix"], task_ids, mix)
        p = sign_test_p(w, lo_)
        out.append(
            Target(
                4, what4, f"{w} / {lo_}, p = {_p(p)}", test4, "reached" if p < ALPHA else "missed", {"p": p}
            )
        )

    # (5) the bonus against its control.
    what5 = (
        f"RL with the bonus uses at least {BONUS_TARGET:.0%} fewer tool calls on co-solved cells than RL "
        "without it, with an interval that excludes 0"
    )
    test5 = (
        "rl_mix vs rl_mix_nobonus on the cells of the mix both solved: mean calls' ratio - 1 at most "
        f"-{BONUS_TARGET:.2f}, and its 95 % paired bootstrap interval ({BOOTSTRAP_RESAMPLES} resamples of "
        "co-solved cells, seed 0) below 0"
    )
    if "rl_mix" not in finals or "rl_mix_nobonus" not in finals:
        out.append(missing(5, what5, test5, ["rl_mix", "rl_mix_nobonus"]))
    else:
        r = call_ratio(co_solved_calls(finals["rl_mix"], finals["rl_mix_nobonus"], mix))
        ok = r.change is not None and r.change <= -BONUS_TARGET and r.high is not None and r.high < 0
        out.append(
            Target(
                5,
                what5,
                format_change(r) + f" ({r.fewer} cells fewer, {r.more} more)",
                test5,
                "reached" if ok else "missed",
                {"change": r.change, "low": r.low, "high": r.high, "cells": r.cells},
            )
        )

    # (6) the unseen harness: measured and reported, no threshold.
    what6 = "the unseen harness (no stage trained in it): every checkpoint's pass@1 there, against the base"
    test6 = "each checkpoint vs base on the unseen harness's cells: two-sided exact sign test (no stated direction)"
    if not unseen or base is None:
        out.append(Target(6, what6, "-", test6, "not measured", {"missing": ["eval_unseen"]}))
    else:
        parts = []
        for h in unseen:
            row = [f"{h}: base {_rate(base, task_ids, h)[1]:.2f}"]
            for stage, f in finals.items():
                if stage == "base":
                    continue
                w, lo_ = won_lost(base, f, task_ids, [h])
                row.append(
                    f"{stage} {_rate(f, task_ids, h)[1]:.2f} ({w} / {lo_}, p = {_p(two_sided_sign_p(w, lo_))})"
                )
            parts.append(", ".join(row))
        out.append(Target(6, what6, "; ".join(parts), test6, "measured"))
    return out


def _solved(finals: Finals, task: str, harness: str) -> bool:
    a = finals.get((task, harness))
    return a is not None and a.solved


def targets_table(found: Sequence[Target]) -> list[str]:
    lines = [
        "| target | figure | test | result |",
        "|---|---|---|---|",
    ]
    for t in found:
        lines.append(f"| ({t.number}) {t.what} | {t.figure} | {t.test} | **{t.status}** |")
    return lines


@dataclass
class BonusAccounting:
    """What the tool-call bonus had to act on in one RL stage, from its ``attempts.jsonl``.

    With the published bonus (``correct x (1 + 0.1 x 15 / (15 + calls))``) one call more changes a
    correct attempt's reward by about 0.005: next to a group's correct / wrong split that moves
    nothing. Only in a group whose graded attempts are all correct but used different numbers of
    calls is the bonus the whole signal (GRPO divides by the group's std, so those advantages are
    full size); ``bonus_only_groups`` counts them. ``correct_calls`` shows whether RL moved the
    calls: per harness (harnesses differ in calls per solution: Mini-SWE-Agent's submit command is
    one), the correct attempts' mean calls in the first and the second half of the stage's correct
    attempts there, by the policy version that sampled them."""

    groups: int
    signal_groups: int
    bonus_only_groups: int
    correct_calls: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)


def bonus_accounting(attempts: Sequence[Mapping[str, Any]]) -> BonusAccounting:
    graded = [a for a in attempts if a.get("reward") is not None and a.get("exit_reason") != "infra_failure"]
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for a in graded:
        groups.setdefault(str(a.get("group_id")), []).append(a)

    def correct(a: Mapping[str, Any]) -> bool:
        return float((a.get("reward_terms") or {}).get("correctness") or 0.0) >= 1.0

    signal = bonus_only = 0
    for members in groups.values():
        if len(members) < 2:
            continue
        rewards = [float(a["reward"]) for a in members]
        if max(rewards) - min(rewards) <= 1e-12:
            continue
        signal += 1
        bonus_only += all(correct(a) for a in members)

    def mean_calls(part: Sequence[Mapping[str, Any]]) -> float | None:
        return sum(float(a["tool_calls"]) for a in part) / len(part) if part else None

    calls: dict[str, tuple[float | None, float | None]] = {}
    for harness in sorted({str(a.get("harness")) for a in graded}):
        solved = sorted(
            (
                a
                for a in graded
                if a.get("harness") == harness and correct(a) and a.get("tool_calls") is not None
            ),
            key=lambda a: int(a.get("policy_version") or 0),
        )
        half = len(solved) // 2
        calls[harness] = (mean_calls(solved[:half]), mean_calls(solved[half:]))
    return BonusAccounting(
        groups=sum(1 for m in groups.values() if len(m) >= 2),
        signal_groups=signal,
        bonus_only_groups=bonus_only,
        correct_calls=calls,
    )


def format_bonus_accounting(b: BonusAccounting) -> str:
    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    per_harness = ", ".join(f"{h} {f(early)} → {f(late)}" for h, (early, late) in b.correct_calls.items())
    return (
        f"groups with two or more graded attempts {b.groups}, with signal {b.signal_groups}, of which "
        f"{b.bonus_only_groups} all correct with different call counts (the bonus the whole signal); "
        f"tool calls per correct attempt, the stage's first half → its second: {per_harness or '-'}"
    )
