"""Deterministic grader: exact -> numeric (per-task tolerance) -> list / percent -> symbolic.

No model is in the loop. `grade` returns 1.0 or 0.0 with a reason, or ``score=None`` when no grade
is possible (the grader itself failed); `grade_workdir` reads ``answer.txt`` from an attempt's
working directory (a missing file is a wrong answer, 0.0).

How free text is read (see `normalize.py` for the details):

* Only the first answer line counts; later lines are explanation. List answers may also be
  written one item per line.
* The answer sits at the start of that line, after an optional label ("The answer is", "Final
  answer:"). Trailing explanations after a delimiter (" (", " because", ", ", "; ", " - ", a sentence
  end) are ignored; units, currency signs and comma thousands separators are ignored around a number.
* Adversarial rules: several different numbers in the answer span make a numeric answer ambiguous
  (0.0, "42 or 43"); a gold answer buried further along a long text is not searched for (0.0); a
  yes/no answer that also contains the opposite word is a hedge (0.0); list answers must have the
  same number of items as the gold list, so padding a list with candidates fails. Items are split
  on ";" when present, else "|", else ","; one item per line also works. Numbers inside a comma
  list must therefore be written without thousands separators.
* Percentages: a gold percentage ("12.5%", or answer type "percentage") accepts "12.5%", "12.5" and
  the fraction "0.125"; a plain numeric gold accepts "12.5%" as 12.5 or 0.125.
* Numbers match when ``|pred - gold| <= max(atol, rtol * |gold|)``; match mode "exact" forces zero
  tolerance (but still accepts "42.0" for "42" and "1,234" for "1234").
* ``answer.txt`` that is a symbolic link is refused (0.0): following it could let an agent point the
  grader at a file it should never read.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fineenvs.tasks import normalize as nz
from fineenvs.tasks.model import ANSWER_FILE, HiddenAnswer
from fineenvs.tasks.symbolic import equivalent

if TYPE_CHECKING:
    from fineenvs.tasks.model import Task

MAX_ANSWER_BYTES = 1_000_000
MAX_LIST_ITEMS = 500


@dataclass(frozen=True)
class Grade:
    """1.0 / 0.0, or None when no grade was possible; `reason` says why; `rung` which rule decided."""

    score: float | None
    reason: str
    rung: str = ""


def grade(prediction: str | None, hidden: HiddenAnswer) -> Grade:
    """Grade one prediction. Never raises: a grader failure is ``Grade(None, reason)``."""
    if prediction is None:
        return Grade(0.0, "no answer was given", "none")
    try:
        return _grade(prediction, hidden)
    except Exception as exc:  # noqa: BLE001 - a crash must become "ungraded", not a trainer crash
        return Grade(None, f"grader error, attempt left ungraded: {type(exc).__name__}: {exc}", "error")


def grade_workdir(task: Task, workdir: Path) -> Grade:
    """Grade ``<workdir>/answer.txt`` against the task's hidden answer."""
    path = Path(workdir) / ANSWER_FILE
    try:
        if path.is_symlink():
            return Grade(0.0, f"{ANSWER_FILE} is a symbolic link; refused (write the answer itself)", "none")
        if not path.exists():
            return Grade(0.0, f"no {ANSWER_FILE} in the working directory (the agent did not answer)", "none")
        if not path.is_file():
            return Grade(0.0, f"{ANSWER_FILE} is not a regular file", "none")
        with path.open("rb") as handle:
            data = handle.read(MAX_ANSWER_BYTES)
    except OSError as exc:
        return Grade(None, f"could not read {path}: {exc}; attempt left ungraded", "error")
    return grade(data.decode("utf-8", errors="replace"), task.hidden)


def _grade(prediction: str, hidden: HiddenAnswer) -> Grade:
    text = nz.prepare(prediction)
    if not text.strip():
        return Grade(0.0, "the answer is empty", "none")
    line = nz.answer_line(text)
    if not line:
        return Grade(0.0, "no answer line found (only fences, labels or blank lines)", "none")
    span = nz.answer_span(line)
    gold = hidden.gold
    kind, mode = hidden.answer_type, hidden.match_mode
    is_list = kind in ("list", "csv_list") or mode in ("list", "ordered_list")
    # A list's span would be its first item: only the whole line may match a list exactly.
    candidates = [line] if is_list else _unique([line, span, nz.span_tail(span)])

    # Rung 1: exact (normalised) match of the line, its span, or the value after "label:".
    gold_key = nz.normalize_text(gold)
    for candidate in candidates:
        if nz.normalize_text(candidate) == gold_key or _loose(candidate) == _loose(gold):
            return Grade(1.0, f"exact match: {candidate!r}", "exact")
    if kind == "free_form" and nz.normalize_text(" ".join(nz.content_lines(text))) == gold_key:
        return Grade(1.0, "exact match of the whole text", "exact")

    if is_list:
        return _grade_list(text, hidden)
    if kind == "yes_no" or mode == "yes_no" or gold_key in nz.YES_WORDS | nz.NO_WORDS:
        return _grade_yes_no(span, gold_key)

    gold_number = nz.parse_number_exactly(gold)
    if gold_number is not None:
        return _grade_number(span, gold_number, hidden)

    # A plain word label ("E", "I") must not be read as a constant (Euler's number, the imaginary unit).
    if mode != "exact" and (kind != "label" or re.search(r"[0-9*/^+]", gold)):
        for candidate in candidates:
            if equivalent(candidate, gold, atol=hidden.atol, rtol=hidden.rtol):
                return Grade(1.0, f"symbolically equivalent: {candidate!r}", "symbolic")
    return Grade(0.0, f"no match: read {span!r}, expected {gold!r}", "none")


def _grade_number(span: str, gold: nz.ParsedNumber, hidden: HiddenAnswer) -> Grade:
    exact = hidden.match_mode == "exact"
    atol, rtol = (0.0, 0.0) if exact else (hidden.atol, hidden.rtol)
    reading = nz.read_number(span)
    if reading.ambiguous:
        shown = ", ".join(f"{v:g}" for v in reading.ambiguous[:5])
        return Grade(0.0, f"ambiguous: several numbers in the answer ({shown}); give one", "numeric")
    pred = reading.number
    if pred is None:
        if not exact and equivalent(span, f"{gold.value!r}", atol=atol, rtol=rtol):
            return Grade(1.0, f"symbolically equivalent: {span!r}", "symbolic")
        return Grade(0.0, f"no number in the answer {span!r}", "numeric")

    def close(value: float) -> bool:
        return abs(value - gold.value) <= max(atol, rtol * abs(gold.value))

    tolerance = f"atol={atol:g}, rtol={rtol:g}"
    if close(pred.value):
        return Grade(1.0, f"numeric match: {pred.value:.10g} vs {gold.value:.10g} ({tolerance})", "numeric")
    gold_is_percent = gold.percent or hidden.answer_type == "percentage" or hidden.match_mode == "percent"
    if not exact and gold_is_percent and not pred.percent and close(pred.value * 100):
        return Grade(1.0, f"percent match: fraction {pred.value:.10g} = {gold.value:.10g}%", "percent")
    if not exact and pred.percent and not gold_is_percent and close(pred.value / 100):
        return Grade(1.0, f"percent match: {pred.value:.10g}% = {gold.value:.10g}", "percent")
    # Only an expression ("sqrt(2)", "pi/2") can still be right; a plain number was read correctly.
    symbolic = re.search(r"[A-Za-z(*^/]", span) is not None
    if not exact and symbolic and equivalent(span, f"{gold.value!r}", atol=atol, rtol=rtol):
        return Grade(1.0, f"symbolically equivalent: {span!r}", "symbolic")
    return Grade(
        0.0, f"numeric mismatch: {pred.value:.10g} vs gold {gold.value:.10g} ({tolerance})", "numeric"
    )


def _grade_yes_no(span: str, gold_key: str) -> Grade:
    gold = "yes" if gold_key in nz.YES_WORDS else "no"
    pred = nz.read_yes_no(span)
    if pred is None:
        return Grade(0.0, f"not a clear yes/no answer: {span!r}", "yes_no")
    if pred == gold:
        return Grade(1.0, f"yes/no match: {pred}", "yes_no")
    return Grade(0.0, f"yes/no mismatch: {pred} vs gold {gold}", "yes_no")


def _grade_list(text: str, hidden: HiddenAnswer) -> Grade:
    pred = nz.split_list(text, multiline=True)
    gold = nz.split_list(hidden.gold, multiline=True)
    if len(pred) > MAX_LIST_ITEMS:
        return Grade(0.0, f"list has {len(pred)} items, more than the {MAX_LIST_ITEMS} read", "list")
    if len(pred) == 1 and len(gold) > 1 and not any(" and " in g.casefold() for g in gold):
        pred = [p for p in re.split(r"\s+and\s+", pred[0], flags=re.IGNORECASE) if p]  # "A and B"
    if len(pred) != len(gold):
        return Grade(0.0, f"list has {len(pred)} items, expected {len(gold)}", "list")

    def same(a: str, b: str) -> bool:
        if nz.normalize_text(a) == nz.normalize_text(b) or _loose(a) == _loose(b):
            return True
        na, nb = nz.parse_number_exactly(a), nz.parse_number_exactly(b)
        return (
            na is not None
            and nb is not None
            and abs(na.value - nb.value) <= max(hidden.atol, hidden.rtol * abs(nb.value))
        )

    if hidden.match_mode == "ordered_list":
        for i, (a, b) in enumerate(zip(pred, gold, strict=True)):
            if not same(a, b):
                return Grade(0.0, f"ordered list differs at item {i + 1}: {a!r} vs {b!r}", "list")
        return Grade(1.0, f"ordered list match ({len(gold)} items)", "list")
    if _perfect_matching(pred, gold, same):
        return Grade(1.0, f"list match, order ignored ({len(gold)} items)", "list")
    return Grade(0.0, f"list items differ: {pred!r} vs expected {len(gold)} items", "list")


def _perfect_matching(pred: list[str], gold: list[str], same: Callable[[str, str], bool]) -> bool:
    """Every predicted item pairs with a distinct gold item (Kuhn's augmenting paths)."""
    edges = [[j for j, g in enumerate(gold) if same(p, g)] for p in pred]
    owner: dict[int, int] = {}

    def assign(i: int, seen: set[int]) -> bool:
        for j in edges[i]:
            if j in seen:
                continue
            seen.add(j)
            if j not in owner or assign(owner[j], seen):
                owner[j] = i
                return True
        return False

    return all(assign(i, set()) for i in range(len(pred)))


def _loose(text: str) -> str:
    """Case, and spaces/underscores/hyphens between letters, ignored: "New-York" == "new_york".

    Only separators between two letters go, so "-42" never loosens into "42".
    """
    return re.sub(r"(?<=[^\W\d_])[\s_\-]+(?=[^\W\d_])", "", nz.normalize_text(text))


def _unique(items: list[str]) -> list[str]:
    return [item for i, item in enumerate(items) if item and item not in items[:i]]
