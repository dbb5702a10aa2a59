"""Turning an agent's free text into a comparable answer: answer line, answer span, numbers, lists.

The rules (also the grader's documented adversarial rules, see `grader.py`):

1. **Only the first answer line counts.** Code fences, blank lines and a bare label line
   ("Answer:") are skipped; everything after the first real line is explanation and ignored
   (except for list answers, which may be written one item per line).
2. **The answer sits at the start of that line.** A label prefix ("The answer is", "Final answer:",
   "Result =") is removed, then the line is cut at the first explanation delimiter (" (", " because",
   "; ", " - ", ", ", a sentence end, ...). The part before the cut is the *answer span*. The grader
   compares the gold answer with the whole cleaned line and with the span, never with a substring
   found further along, so an answer buried in a long text scores 0.
3. **One number per numeric answer.** If the span holds several different numbers ("42 or 43",
   "between 10 and 12"), the answer is ambiguous and scores 0: listing candidates must never pay.
   "Mean of column 3: 42.5" is read as 42.5 because the value after the last ": ", "=" or " is " wins.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_PREDICTION_CHARS = 20_000

_FENCE = re.compile(r"^\s*```[\w+-]*\s*$")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_LABEL_PREFIX = re.compile(
    r"^\s*(?:(?:my|the|our)\s+)?(?:final\s+)?(?:answer|result|output|solution)\s*(?:is|was|:|=|-)?\s*",
    re.IGNORECASE,
)
_BULLET = re.compile(r"^\s*(?:[-*\u2022]|\d{1,3}[.)])\s+")
_QUOTES = "\"'`\u201c\u201d\u2018\u2019"
_DELIMITERS = re.compile(
    r"\s+\(|\s*\[|;|\s+[-\u2013\u2014]\s+|\u2014|,\s+|\.\s+(?=\S)|"
    r"\s+(?:because|since|as|which|where|based\s+on|rounded|approximately|approx\.?|according)\b",
    re.IGNORECASE,
)
_TAIL_SEPARATORS = re.compile(r"(?::\s+|=|\s+is\s+|\s+are\s+|\s+was\s+)", re.IGNORECASE)

# A number: optional sign, digits with optional comma thousands groups, optional decimals and
# exponent. The look-behind keeps digits inside words ("m2", "Q3") from counting as numbers.
NUMBER = re.compile(
    r"(?<![A-Za-z0-9_.])([-+]?)(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d*)?|\.\d+)(?:[eE]([-+]?\d+))?(?![0-9])"
)
_PERCENT_AFTER = re.compile(r"^\s*(?:%|percent\b|pct\b|per\s*cent\b)", re.IGNORECASE)
_SCALE_AFTER = re.compile(r"^\s*(thousand|million|billion|trillion)\b", re.IGNORECASE)
_SCALES = {"thousand": 1e3, "million": 1e6, "billion": 1e9, "trillion": 1e12}
_FRACTION = re.compile(r"^\s*([-+]?\d+(?:\.\d+)?)\s*/\s*(\d+(?:\.\d+)?)\s*$")

YES_WORDS = {"yes", "y", "true"}
NO_WORDS = {"no", "n", "false"}


@dataclass(frozen=True)
class ParsedNumber:
    value: float
    percent: bool  # written with a percent sign or the word "percent"


@dataclass(frozen=True)
class NumberReading:
    """Result of reading one number from an answer span."""

    number: ParsedNumber | None
    ambiguous: tuple[float, ...] = ()  # the distinct values seen, when there were several


def prepare(text: str) -> str:
    """Common clean-up of raw text: cap the length, unify line ends, minus signs and spaces."""
    text = text[:MAX_PREDICTION_CHARS]
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = text.replace("\u2212", "-").replace("\u00a0", " ").replace("\u202f", " ")
    return _BOXED.sub(r"\1", text)


def content_lines(text: str) -> list[str]:
    """Non-empty lines, code fences dropped, in order."""
    return [line.strip() for line in prepare(text).split("\n") if line.strip() and not _FENCE.match(line)]


def clean_line(line: str) -> str:
    """Strip markdown emphasis, a label prefix, surrounding quotes and trailing punctuation."""
    line = line.strip()
    for marker in ("**", "__"):
        if line.startswith(marker):
            line = line[len(marker) :]
        line = line.replace(marker, "")
    line = _LABEL_PREFIX.sub("", line, count=1)
    line = line.strip().strip(_QUOTES).strip()
    return line.rstrip(".!;,").strip().strip(_QUOTES).strip()


def answer_line(text: str) -> str:
    """The first line that still holds something after `clean_line` (rule 1)."""
    for line in content_lines(text):
        cleaned = clean_line(line)
        if cleaned:
            return cleaned
    return ""


def answer_span(line: str) -> str:
    """The part of the answer line before the first explanation delimiter (rule 2)."""
    match = _DELIMITERS.search(line)
    span = line[: match.start()] if match else line
    return span.strip().rstrip(".!;,:").strip().strip(_QUOTES).strip()


def normalize_text(text: str) -> str:
    """Case-, space- and quote-insensitive form used by the exact rung and list items."""
    text = prepare(text).strip().strip(_QUOTES).strip().rstrip(".").strip()
    return re.sub(r"\s+", " ", text).casefold()


def _match_value(match: re.Match[str], after: str) -> ParsedNumber:
    sign, digits, exponent = match.group(1), match.group(2), match.group(3)
    value = float(digits.replace(",", ""))
    if exponent:
        value *= 10.0 ** int(exponent)
    if sign == "-":
        value = -value
    scale = _SCALE_AFTER.match(after)
    if scale:
        value *= _SCALES[scale.group(1).lower()]
    return ParsedNumber(value=value, percent=bool(_PERCENT_AFTER.match(after)))


def read_number(span: str) -> NumberReading:
    """Read the single number in an answer span (rule 3); a plain fraction "3/4" counts as one."""
    parts = _TAIL_SEPARATORS.split(span)
    for candidate in (parts[-1], span) if len(parts) > 1 else (span,):
        fraction = _FRACTION.match(candidate)
        if fraction and float(fraction.group(2)) != 0:
            return NumberReading(ParsedNumber(float(fraction.group(1)) / float(fraction.group(2)), False))
        numbers = [_match_value(m, candidate[m.end() :]) for m in NUMBER.finditer(candidate)]
        if not numbers:
            continue
        distinct = sorted({n.value for n in numbers})
        if len(distinct) > 1:
            return NumberReading(None, ambiguous=tuple(distinct))
        return NumberReading(numbers[0])
    return NumberReading(None)


def parse_number_exactly(text: str) -> ParsedNumber | None:
    """A number when `text` is nothing but a number (with optional %/scale word), else None.

    Used for gold answers and list items, where there is no explanation to strip.
    """
    text = prepare(text).strip().strip(_QUOTES).strip().lstrip("$\u20ac\u00a3").strip()
    fraction = _FRACTION.match(text)
    if fraction and float(fraction.group(2)) != 0:
        return ParsedNumber(float(fraction.group(1)) / float(fraction.group(2)), False)
    match = NUMBER.match(text)
    if not match:
        return None
    rest = text[match.end() :]
    parsed = _match_value(match, rest)
    rest = _PERCENT_AFTER.sub("", rest, count=1) if parsed.percent else rest
    rest = _SCALE_AFTER.sub("", rest, count=1)
    return parsed if not rest.strip() else None


def read_yes_no(span: str) -> str | None:
    """ "yes" / "no" from the first word of the span; None when absent or when both appear."""
    words = re.findall(r"[a-z]+", span.casefold())
    if not words or words[0] not in YES_WORDS | NO_WORDS:
        return None
    first = "yes" if words[0] in YES_WORDS else "no"
    opposite = NO_WORDS if first == "yes" else YES_WORDS
    if any(w in opposite and len(w) > 1 for w in words[1:]):
        return None  # "yes/no", "yes and no": a hedge, not an answer
    return first


def split_list(text: str, *, multiline: bool) -> list[str]:
    """Items of a list answer: one line separated by ; | or commas, or one item per line."""
    lines = content_lines(text)
    if not lines:
        return []
    first = clean_line(lines[0])
    first = _strip_brackets(first)
    if multiline and len(lines) > 1 and not re.search(r"[,;|]", first):
        raw = [_BULLET.sub("", clean_line(line)) for line in lines]
    else:
        separator = ";" if ";" in first else "|" if "|" in first else ","
        raw = first.split(separator)
    items = []
    for item in raw:
        item = re.sub(r"^\s*and\s+", "", item.strip(), flags=re.IGNORECASE)
        item = item.strip().strip(_QUOTES).strip().rstrip(".").strip()
        if item:
            items.append(item)
    return items


def _strip_brackets(text: str) -> str:
    text = text.strip()
    if len(text) >= 2 and text[0] + text[-1] in ("[]", "()", "{}"):
        return text[1:-1]
    return text


def span_tail(span: str) -> str:
    """The value after the last ": ", "=" or " is " of a span ("Top region: North" -> "North")."""
    parts = _TAIL_SEPARATORS.split(span)
    return parts[-1].strip().strip(_QUOTES).strip() if len(parts) > 1 else span
