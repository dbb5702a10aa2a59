"""Evaluation results, pure: pass@1 per checkpoint x harness, co-solved tool calls, intervals.

What the evaluation job (``fineenvs.jobs.eval``) writes to ``eval/results.json`` and logs, what
``python -m fineenvs.report`` plots and the mini-reproduction tabulates: computed here from the
stored attempt records (``eval/attempts.jsonl``), with no engine, agent or I/O beyond those files.
See ``fineenvs.jobs.eval`` for how a cell's first graded attempt is chosen and
``results.json``'s layout.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from fineenvs.jsonl import JsonObject, append_jsonl, read_jsonl
from fineenvs.metrics import metric_key

log = logging.getLogger("fineenvs.results")

SCHEMA_VERSION = 1


# --------------------------------------------------------------------------- attempt records


@dataclass
class EvalAttempt:
    """One attempt of one cell, as stored in ``eval/attempts.jsonl``."""

    checkpoint: str
    task_id: str
    harness: str
    try_index: int
    attempt_id: str
    reward: float | None
    exit_reason: str = "finished"
    answered: bool = False
    """``answer.txt`` existed when the agent stopped."""
    tool_calls: int | None = None
    model_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cut_off_calls: int = 0
    """Model calls that ended on the output-token cap (finish_reason ``length``)."""
    duration_seconds: float = 0.0
    error: str | None = None
    step: int | None = None

    @property
    def infra_failure(self) -> bool:
        """No usable grade for a reason outside the policy: retry it.

        An agent that crashed or timed out without an answer is retried, unless one of the model's
        replies was cut at the output-token cap: that reply is the policy's own, and an agent that
        cannot go on from it (Codex fails the turn, Gemini CLI cannot parse the cut JSON) has been
        failed by the policy, as the same reply ends the attempt without an answer elsewhere.
        Retrying it would give such harnesses a second draw the others do not get."""
        if self.reward is None or self.exit_reason == "wiring_failure":
            return True
        return self.exit_reason in ("crashed", "timeout") and not self.answered and not self.cut_off_calls

    @property
    def solved(self) -> bool:
        return self.reward is not None and self.reward > 0

    @classmethod
    def from_json(cls, data: JsonObject) -> EvalAttempt:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def first_graded(attempts: Sequence[EvalAttempt]) -> EvalAttempt | None:
    """The attempt that decides a cell: the first one (by try index) that is not an infra failure."""
    for a in sorted(attempts, key=lambda a: a.try_index):
        if not a.infra_failure:
            return a
    return None


def read_attempts(path: Path) -> list[EvalAttempt]:
    """``eval/attempts.jsonl``; a line cut by a crash mid-write is skipped, so that attempt runs again."""
    out = []
    for record in read_jsonl(path):
        try:
            out.append(EvalAttempt.from_json(record))
        except TypeError as err:
            log.warning("%s: attempt record %s unreadable (%s); ignored", path, record.get("attempt_id"), err)
    return out


def append_attempt(path: Path, attempt: EvalAttempt) -> None:
    append_jsonl(path, asdict(attempt))


# --------------------------------------------------------------------------- results


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def cell_stats(task_ids: Sequence[str], attempts: Sequence[EvalAttempt]) -> JsonObject:
    """Statistics of one checkpoint x harness over ``task_ids`` (attempts of that pair only)."""
    by_task: dict[str, list[EvalAttempt]] = defaultdict(list)
    for a in attempts:
        by_task[a.task_id].append(a)
    finals = {t: first_graded(by_task.get(t, [])) for t in task_ids}
    graded = [a for a in finals.values() if a is not None]
    solved = [a for a in graded if a.solved]
    tools = [float(a.tool_calls) for a in graded if a.tool_calls is not None]
    tried = [a for t in task_ids for a in by_task.get(t, [])]
    exits: dict[str, int] = defaultdict(int)
    for a in graded:
        exits[a.exit_reason] += 1
    n = len(task_ids)
    return {
        "tasks": n,
        "graded": len(graded),
        "solved": len(solved),
        "ungraded": n - len(graded),
        "attempts": len(tried),
        "infra_failures": sum(1 for a in tried if a.infra_failure),
        "pass_at_1": len(solved) / n if n else 0.0,
        "pass_at_1_graded": len(solved) / len(graded) if graded else None,
        "tool_calls_mean": _mean(tools),
        "tool_calls_mean_solved": _mean([float(a.tool_calls) for a in solved if a.tool_calls is not None]),
        "model_calls_mean": _mean([float(a.model_calls) for a in graded]),
        "prompt_tokens": sum(a.prompt_tokens for a in graded),
        "completion_tokens": sum(a.completion_tokens for a in graded),
        "completion_tokens_mean": _mean([float(a.completion_tokens) for a in graded]),
        "timeouts": sum(1 for a in graded if a.exit_reason == "timeout"),
        "context_overflows": sum(1 for a in graded if a.exit_reason == "context_overflow"),
        "budget_stops": sum(1 for a in graded if a.exit_reason == "budget_stop"),
        "cut_off": sum(1 for a in graded if a.cut_off_calls > 0),
        "exit_reasons": dict(sorted(exits.items())),
    }


def co_solved_cells(
    first: Mapping[tuple[str, str], EvalAttempt], second: Mapping[tuple[str, str], EvalAttempt]
) -> list[tuple[str, str]]:
    """The (task, harness) cells both checkpoints solved, each with a tool count, sorted."""
    return sorted(
        k
        for k in first.keys() & second.keys()
        if first[k].solved
        and second[k].solved
        and first[k].tool_calls is not None
        and second[k].tool_calls is not None
    )


def co_solved(
    base: dict[tuple[str, str], EvalAttempt],
    other: dict[tuple[str, str], EvalAttempt],
    harnesses: Sequence[str],
) -> JsonObject:
    """Tool calls on the (task, harness) cells both checkpoints solved (with a tool count on both)."""

    def summary(keys: list[tuple[str, str]]) -> JsonObject:
        b = [float(base[k].tool_calls or 0) for k in keys]
        o = [float(other[k].tool_calls or 0) for k in keys]
        mb, mo = _mean(b), _mean(o)
        reduction = 1.0 - mo / mb if mb and mo is not None else None
        return {"cells": len(keys), "mean_tool_calls_base": mb, "mean_tool_calls": mo, "reduction": reduction}

    keys = co_solved_cells(base, other)
    out = summary(keys)
    out["per_harness"] = {h: summary([k for k in keys if k[1] == h]) for h in harnesses}
    return out


def deciding_attempts(attempts: Sequence[EvalAttempt]) -> dict[str, dict[tuple[str, str], EvalAttempt]]:
    """Per checkpoint, the attempt that decides each (task, harness) cell (``first_graded``); a cell
    with no graded attempt is absent."""
    by_cell: dict[tuple[str, str, str], list[EvalAttempt]] = defaultdict(list)
    for a in attempts:
        by_cell[(a.checkpoint, a.task_id, a.harness)].append(a)
    out: dict[str, dict[tuple[str, str], EvalAttempt]] = defaultdict(dict)
    for (c, t, h), items in by_cell.items():
        final = first_graded(items)
        if final is not None:
            out[c][(t, h)] = final
    return dict(out)


def won_lost(
    first: Mapping[tuple[str, str], EvalAttempt],
    second: Mapping[tuple[str, str], EvalAttempt],
    task_ids: Sequence[str],
    harnesses: Sequence[str],
) -> tuple[int, int]:
    """Cells ``second`` solved and ``first`` did not (won), and the reverse (lost); a cell without a
    graded attempt counts as unsolved, as in pass@1."""
    won = lost = 0
    for h in harnesses:
        for t in task_ids:
            a, b = first.get((t, h)), second.get((t, h))
            solved_a, solved_b = a is not None and a.solved, b is not None and b.solved
            won += solved_b and not solved_a
            lost += solved_a and not solved_b
    return won, lost


def paired(
    first: dict[tuple[str, str], EvalAttempt],
    second: dict[tuple[str, str], EvalAttempt],
    task_ids: Sequence[str],
    harnesses: Sequence[str],
) -> JsonObject:
    """Two checkpoints on the same cells: ``won`` (cells ``second`` solved and ``first`` did not),
    ``lost`` (the reverse) and ``p``, the one-sided exact sign test's chance of at least that many
    wins if ``second`` were no better — over all harnesses and ``per_harness``. Pairing removes the
    tasks' difficulty from the comparison, so it resolves differences that two pass@1 intervals
    over the same tasks cannot. A cell without a graded attempt counts as unsolved, as in pass@1."""

    def count(hs: Sequence[str]) -> JsonObject:
        won, lost = won_lost(first, second, task_ids, hs)
        return {"won": won, "lost": lost, "p": sign_test_p(won, lost)}

    out = count(harnesses)
    out["per_harness"] = {h: count([h]) for h in harnesses}
    return out


def compute_results(
    attempts: Sequence[EvalAttempt],
    *,
    checkpoints: Sequence[str],
    harnesses: Sequence[str],
    task_ids: Sequence[str],
    split: str,
    steps: dict[str, int] | None = None,
) -> JsonObject:
    """The results document (module docstring) from every attempt; attempts outside the given
    checkpoints, harnesses or tasks are ignored."""
    tasks = set(task_ids)
    by_pair: dict[tuple[str, str], list[EvalAttempt]] = defaultdict(list)
    for a in attempts:
        if a.task_id in tasks:
            by_pair[(a.checkpoint, a.harness)].append(a)
    cells = {c: {h: cell_stats(task_ids, by_pair[(c, h)]) for h in harnesses} for c in checkpoints}
    finals = deciding_attempts([a for a in attempts if a.task_id in tasks])
    total = len(task_ids) * len(harnesses)
    results: JsonObject = {
        "schema": SCHEMA_VERSION,
        "split": split,
        "tasks": len(task_ids),
        "harnesses": list(harnesses),
        "checkpoints": list(checkpoints),
        "baseline": checkpoints[0] if checkpoints else None,
        "pass_at_1": {c: {h: cells[c][h]["pass_at_1"] for h in harnesses} for c in checkpoints},
        "overall": {
            c: (sum(cells[c][h]["solved"] for h in harnesses) / total if total else 0.0) for c in checkpoints
        },
        "tool_call_reduction": {},
        "co_solved": {},
        "paired": {},
        "cells": cells,
    }
    if steps:
        results["steps"] = {c: steps[c] for c in checkpoints if c in steps}
    if checkpoints:
        base = checkpoints[0]
        for c in checkpoints[1:]:
            key = f"{c} vs {base}"
            detail = co_solved(finals.get(base, {}), finals.get(c, {}), harnesses)
            results["paired"][key] = paired(finals.get(base, {}), finals.get(c, {}), task_ids, harnesses)
            results["co_solved"][key] = detail
            if detail["reduction"] is not None:
                results["tool_call_reduction"][key] = detail["reduction"]
    return results


def write_results(path: Path, results: JsonObject) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=2))
    tmp.replace(path)


def eval_metrics(results: JsonObject, checkpoint: str) -> dict[str, float]:
    """W&B / metrics.jsonl keys of one checkpoint: ``eval/pass_at_1``, ``eval/harness/<h>/...``."""
    out: dict[str, float] = {metric_key("eval", "pass_at_1"): float(results["overall"][checkpoint])}
    tools: list[float] = []
    for h, cell in results["cells"][checkpoint].items():
        out[metric_key("eval", "pass_at_1", h)] = float(cell["pass_at_1"])
        out[metric_key("eval", "ungraded", h)] = float(cell["ungraded"])
        out[metric_key("eval", "timeouts", h)] = float(cell["timeouts"])
        out[metric_key("eval", "context_overflows", h)] = float(cell["context_overflows"])
        if cell["tool_calls_mean"] is not None:
            out[metric_key("eval", "tool_calls_mean", h)] = float(cell["tool_calls_mean"])
            tools.append(float(cell["tool_calls_mean"]))
        if cell["completion_tokens_mean"] is not None:
            out[metric_key("eval", "completion_tokens_mean", h)] = float(cell["completion_tokens_mean"])
    if tools:
        out[metric_key("eval", "tool_calls_mean")] = statistics.fmean(tools)
    for key, value in results["tool_call_reduction"].items():
        if key.startswith(f"{checkpoint} vs "):
            out[metric_key("eval", "tool_call_reduction")] = float(value)
    return out


def label(checkpoint: str) -> str:
    """A short, distinct name: ``<run>/step-N`` for ``<run>/checkpoints/step-N``, else the last two
    path parts (``base`` and Hub ids stay as they are)."""
    p = Path(checkpoint)
    if p.parent.name == "checkpoints" and p.parent.parent.name:
        return f"{p.parent.parent.name}/{p.name}"
    return f"{p.parent.name}/{p.name}" if p.parent.name and len(p.parts) > 1 else checkpoint


def format_tables(results: JsonObject) -> str:
    """The published tables: checkpoint x harness pass@1 with overall, co-solved tool calls, details."""
    hs: list[str] = results["harnesses"]
    ckpts: list[str] = results["checkpoints"]
    labels = {c: label(c) for c in ckpts}
    w = max([len("checkpoint"), *(len(v) for v in labels.values())])
    cols = [max(len(h), 7) for h in hs]
    lines = [f"pass@1 on {results['tasks']} {results['split']} tasks (first graded attempt)"]
    lines.append(
        f"{'checkpoint':<{w}}  " + "  ".join(f"{h:>{n}}" for h, n in zip(hs, cols, strict=True)) + "  overall"
    )
    for c in ckpts:
        row = "  ".join(
            f"{results['pass_at_1'][c][h] * 100:>{n - 1}.1f}%" for h, n in zip(hs, cols, strict=True)
        )
        lines.append(f"{labels[c]:<{w}}  {row}  {results['overall'][c] * 100:>6.1f}%")
    if results["co_solved"]:
        lines.append("")
        lines.append("tool calls on co-solved tasks (reduction = 1 - mean(checkpoint) / mean(baseline))")
        for key, d in results["co_solved"].items():
            red = "-" if d["reduction"] is None else f"{d['reduction'] * 100:.1f}%"
            mb = "-" if d["mean_tool_calls_base"] is None else f"{d['mean_tool_calls_base']:.2f}"
            mo = "-" if d["mean_tool_calls"] is None else f"{d['mean_tool_calls']:.2f}"
            lines.append(f"  {key}: {d['cells']} cells, baseline {mb} -> {mo} tool calls, reduction {red}")
    if results.get("paired"):
        lines.append("")
        lines.append("paired against the baseline (cells won / lost, one-sided exact sign test)")
        for key, d in results["paired"].items():
            lines.append(f"  {key}: won {d['won']}, lost {d['lost']}, p = {d['p']:.2g}")
    lines.append("")
    lines.append(
        f"{'checkpoint':<{w}}  {'harness':<14} {'graded':>6} {'solved':>6} {'ungraded':>8} {'tools':>6} "
        f"{'out tok':>8} {'timeouts':>8} {'ctx ovf':>7} {'cut off':>7}"
    )
    for c in ckpts:
        for h in hs:
            s = results["cells"][c][h]
            tools = "-" if s["tool_calls_mean"] is None else f"{s['tool_calls_mean']:.1f}"
            tok = "-" if s["completion_tokens_mean"] is None else f"{s['completion_tokens_mean']:.0f}"
            lines.append(
                f"{labels[c]:<{w}}  {h:<14} {s['graded']:>6} {s['solved']:>6} {s['ungraded']:>8} {tools:>6} "
                f"{tok:>8} {s['timeouts']:>8} {s['context_overflows']:>7} {s['cut_off']:>7}"
            )
    return "\n".join(lines)


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion (over tasks)."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def sign_test_p(wins: int, losses: int) -> float:
    """One-sided exact sign test (McNemar) for paired outcomes: the chance that at least ``wins`` of
    the ``wins + losses`` tasks where two checkpoints differ go to the second if neither is better."""
    n = wins + losses
    return sum(math.comb(n, k) for k in range(wins, n + 1)) / 2**n if n else 1.0
