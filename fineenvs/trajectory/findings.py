"""Validation findings attached to every session (graded fatal / warning / info).

A session with a fatal finding exports no training rows; the findings say why. Codes:

fatal
  ``no_calls``            the agent never reached the model (wiring failure, not a wrong answer)
  ``degenerate_session``  exactly one model call for an agentic task (published: harnesses that
                          "passed" with one turn solved 0/5); ``min_calls`` sets the threshold
  ``no_prompt_ids``       a call without prompt token ids cannot be placed in the graph
  ``positive_logprob``    a behaviour logprob > 0: the engine returned something else
  ``length_mismatch``     a row's mask, logprobs or weights do not align with its ids
  ``masked_has_logprob``  a context token carries a logprob (alignment bug upstream)
  ``nothing_trainable``   no row has a single trainable token (e.g. no call had logprobs)
warning
  ``no_sampled_ids``, ``no_logprobs``, ``logprob_misalign`` (the call is context only),
  ``multiple_roots``, ``per_turn_capture_only`` (every call its own root: the harness re-renders
  instead of appending), ``discarded_turns``, ``retry_storm`` (a call retried ``retry_storm``
  times or more), ``drift_breaks``, ``overlong_rows``
info
  ``late_parents`` (calls that arrived before their parent and were adopted), ``certain_tokens``
  (sampled tokens with logprob exactly 0.0)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Literal

from fineenvs.trajectory.graph import TrajectoryGraph
from fineenvs.trajectory.node import has_positive_logprob, logprob_problem
from fineenvs.trajectory.rows import RowSet

Level = Literal["fatal", "warning", "info"]


@dataclass(frozen=True)
class Finding:
    level: Level
    code: str
    message: str


def is_fatal(findings: list[Finding]) -> bool:
    return any(f.level == "fatal" for f in findings)


def refusal(findings: list[Finding]) -> str | None:
    """Why a session exports no training rows, or None when it does."""
    fatal = [f for f in findings if f.level == "fatal"]
    if not fatal:
        return None
    return "; ".join(f"{f.code}: {f.message}" for f in fatal)


def validate(
    graph: TrajectoryGraph, rows: RowSet | None = None, *, min_calls: int = 2, retry_storm: int = 3
) -> list[Finding]:
    """Everything wrong or notable about one session, most severe first."""
    out: list[Finding] = []
    n = len(graph)
    if n == 0:
        return [
            Finding("fatal", "no_calls", "the session has no model calls: the agent never reached the proxy")
        ]
    if n < min_calls:
        out.append(
            Finding(
                "fatal",
                "degenerate_session",
                f"{n} model call(s), fewer than min_calls={min_calls}: an agentic task solved in one call "
                "means the harness did not run its loop",
            )
        )
    ids = graph.node_ids()
    _per_call(graph, ids, out)
    stats = graph.stats()
    if stats.n_roots > 1:
        if stats.n_roots == n:
            out.append(
                Finding(
                    "warning",
                    "per_turn_capture_only",
                    f"all {n} calls are roots: the harness re-renders history instead of appending to it",
                )
            )
        else:
            out.append(Finding("warning", "multiple_roots", f"{stats.n_roots} roots (subagents, compaction)"))
    if stats.n_discarded:
        out.append(Finding("warning", "discarded_turns", f"{stats.n_discarded} call(s) discarded as retries"))
        per_parent = Counter(graph.parent(d) for d in graph.discarded())
        worst, count = per_parent.most_common(1)[0]
        if count >= retry_storm:
            where = f"after call {worst}" if worst is not None else "at the first call"
            out.append(Finding("warning", "retry_storm", f"{count} retries {where}"))
    drift = graph.drift_breaks()
    if drift:
        first = drift[0]
        out.append(
            Finding(
                "warning",
                "drift_breaks",
                f"{len(drift)} call(s) re-rendered earlier output; first: {first.node_id} departs from "
                f"{first.nearly_extends}'s sampled tokens at offset {first.sampled_offset} "
                f"(prompt position {first.position}, {first.lost_tokens} tokens lost)",
            )
        )
    if stats.n_late_parents:
        out.append(
            Finding("info", "late_parents", f"{stats.n_late_parents} call(s) arrived before their parent")
        )
    if rows is not None:
        _per_rows(rows, out)
    order = {"fatal": 0, "warning": 1, "info": 2}
    return sorted(out, key=lambda f: order[f.level])


def _per_call(graph: TrajectoryGraph, ids: list[str], out: list[Finding]) -> None:
    problems: dict[str, list[str]] = {}
    certain = 0
    for nid in ids:
        h = graph.header(nid)
        n_sampled = graph.end_len(nid) - graph.prompt_len(nid)
        if graph.prompt_len(nid) == 0:
            problems.setdefault("no_prompt_ids", []).append(nid)
        if n_sampled == 0:
            problems.setdefault("no_sampled_ids", []).append(nid)
            continue
        if has_positive_logprob(h):
            problems.setdefault("positive_logprob", []).append(nid)
        why = logprob_problem(h, n_sampled)
        if why is not None:
            code = "no_logprobs" if h.logprobs is None else "logprob_misalign"
            problems.setdefault(code, []).append(f"{nid} ({why})")
        elif h.logprobs is not None:
            certain += sum(1 for lp in h.logprobs if lp == 0.0)
    levels: dict[str, Level] = {
        "no_prompt_ids": "fatal",
        "positive_logprob": "fatal",
        "no_sampled_ids": "warning",
        "no_logprobs": "warning",
        "logprob_misalign": "warning",
    }
    texts = {
        "no_prompt_ids": "call(s) without prompt token ids (the engine must return prompt_token_ids)",
        "positive_logprob": "call(s) with a logprob > 0 (check the engine's logprobs mode)",
        "no_sampled_ids": "call(s) sampled no tokens",
        "no_logprobs": "call(s) without logprobs, kept as context only",
        "logprob_misalign": "call(s) with unusable logprobs, kept as context only",
    }
    for code, who in problems.items():
        shown = ", ".join(who[:5]) + (f" and {len(who) - 5} more" if len(who) > 5 else "")
        out.append(Finding(levels[code], code, f"{len(who)} {texts[code]}: {shown}"))
    if certain:
        out.append(Finding("info", "certain_tokens", f"{certain} sampled token(s) with logprob exactly 0.0"))


def _per_rows(rows: RowSet, out: list[Finding]) -> None:
    for row in rows.rows:
        n = len(row.input_ids)
        lengths = {len(row.loss_mask), len(row.logprobs)}
        if row.loss_weight is not None:
            lengths.add(len(row.loss_weight))
        if lengths != {n}:
            out.append(
                Finding("fatal", "length_mismatch", f"row {row.row_id}: {n} ids but lengths {lengths}")
            )
            continue
        if any(lp != 0.0 and m == 0 for lp, m in zip(row.logprobs, row.loss_mask, strict=True)):
            out.append(
                Finding("fatal", "masked_has_logprob", f"row {row.row_id}: a context token has a logprob")
            )
    live = [r for r in rows.rows if r.role != "discarded"]
    if not any(r.n_trainable for r in live):
        out.append(
            Finding(
                "fatal",
                "nothing_trainable",
                f"none of the {len(live)} exported row(s) has a trainable token (calls without usable "
                "logprobs are context only)",
            )
        )
    if rows.overlong_rows:
        out.append(
            Finding(
                "warning",
                "overlong_rows",
                f"{rows.overlong_rows} row(s) over max_tokens={rows.options.max_tokens} "
                f"({rows.options.overlong.value}): {rows.dropped_overlong} dropped, {rows.split_rows} cut, "
                f"{rows.lost_sampled_tokens} trainable tokens lost",
            )
        )
