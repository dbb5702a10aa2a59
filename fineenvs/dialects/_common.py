"""The request-side checks the four format modules share: errors that say what, why and the fix,
typed field reads, the documented numeric ranges, ids and our reasoning signatures.

What is covered: reading an agent's request the same way in every format. What is not covered:
the canonical shapes built from it (``canonical``), the reply side (``reply``), and anything
format-specific; that lives in the format's own module, even when it looks similar (duplicate
glue, share contracts).
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypeVar

from fineenvs.dialects.base import JSON, CanonicalRequest, DialectError

T = TypeVar("T")

ERROR_PREFIX = "fineenvs proxy: "
# Our own prefix for synthetic signatures / encrypted reasoning, so we can tell ours from a real
# provider's opaque blob (which we cannot read) when a client sends history back.
SIG_PREFIX = "fe:"


def prefixed(message: str) -> str:
    return message if message.startswith(ERROR_PREFIX) else ERROR_PREFIX + message


def fail(what: str, why: str, fix: str, *, param: str | None = None, status: int = 400) -> DialectError:
    """A DialectError whose message says what is wrong, why it matters and how to fix it."""
    return DialectError(f"{what}: {why}. {fix}", status=status, param=param)


def as_dict(value: object) -> JSON:
    """``value`` if it is an object, else an empty one (for optional sub-objects)."""
    return value if isinstance(value, dict) else {}


def as_str(value: object, default: str = "") -> str:
    return value if isinstance(value, str) else default


def type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _require(value: object, kind: type[T], where: str, noun: str, json_noun: str) -> T:
    if not isinstance(value, kind):
        raise fail(
            f"{where} must be {noun} (got {type_name(value)})",
            f"the format defines it as {json_noun}",
            f"Send {where} as {json_noun}.",
            param=where,
        )
    return value


def require_dict(value: object, where: str) -> JSON:
    return _require(value, dict, where, "an object", "a JSON object")


def require_list(value: object, where: str) -> list[object]:
    return _require(value, list, where, "an array", "a JSON array")


def require_str(value: object, where: str) -> str:
    return _require(value, str, where, "a string", "a string")


def require_objects(value: object, where: str) -> Iterator[tuple[int, str, JSON]]:
    """Each element of the array ``value`` as ``(index, its place, the object)``.

    Lazily, so that a bad element is reported only after the elements before it were converted
    (the first error in the request is the one the agent sees).
    """
    for k, item in enumerate(require_list(value, where)):
        item_where = f"{where}[{k}]"
        yield k, item_where, require_dict(item, item_where)


def string_list(value: object, where: str) -> list[str]:
    return [require_str(s, f"{where}[]") for s in require_list(value, where)]


def unsupported(where: str, value: object, why: str, fix: str, *, field: str = "type") -> DialectError:
    """The error for a field whose value the proxy does not convert (a role, a part or item type)."""
    return fail(f"{where}.{field}={value!r} is not supported", why, fix, param=f"{where}.{field}")


def by_status(table: dict[int, str], status: int, *, server: str, client: str) -> str:
    """A format's error name for ``status``: from its table, else its generic server or client name."""
    return table.get(status, server if status >= 500 else client)


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class Range:
    """The values a numeric field accepts: ``[low, high]`` (``low_open``: ``low`` excluded)."""

    low: float
    high: float
    integer: bool
    why: str
    low_open: bool = False

    def text(self) -> str:
        kind = "an integer" if self.integer else "a number"
        left = "(" if self.low_open else "["
        return f"{kind} in {left}{_num(self.low)}, {_num(self.high)}]"


def _num(x: float) -> str:
    if x == INT64_MAX:
        return "2^63-1"
    if x == INT64_MIN:
        return "-2^63"
    return f"{x:g}" if isinstance(x, float) else str(x)


# The documented ranges of the chat-completions fields every format maps onto (OpenAI's, where
# vLLM accepts more; a dialect passes its own where its API documents another, e.g. Anthropic's
# temperature). Checked at the edge so that no out-of-range number reaches the engine (or a
# 64-bit conversion) and every caller gets its own format's 400 with the accepted range.
RANGES: dict[str, Range] = {
    "max_tokens": Range(1, INT64_MAX, True, "it caps the number of generated tokens"),
    "temperature": Range(0, 2, False, "it divides the logits (0 is greedy)"),
    "top_p": Range(0, 1, False, "it is a share of the probability mass", low_open=True),
    "top_k": Range(-1, INT64_MAX, True, "it keeps the k most likely tokens (-1 or 0: off)"),
    "min_p": Range(0, 1, False, "it is a probability relative to the most likely token"),
    "presence_penalty": Range(-2, 2, False, "it is a penalty on tokens already present"),
    "frequency_penalty": Range(-2, 2, False, "it is a penalty on frequent tokens"),
    "repetition_penalty": Range(
        0, 2**31, False, "it multiplies the logits of repeated tokens", low_open=True
    ),
    "seed": Range(INT64_MIN, INT64_MAX, True, "it seeds a 64-bit random generator"),
    "top_logprobs": Range(0, 20, True, "it is how many alternatives are returned per token"),
}


def check_number(value: object, where: str, rule: Range) -> float | int:
    """``value`` if it is a finite number within ``rule``, else the caller's 400 saying the range."""
    problem = None
    if isinstance(value, bool) or not isinstance(value, int | float):
        problem = f"{where} must be a number (got {type_name(value)})"
    elif isinstance(value, float) and not math.isfinite(value):
        problem = f"{where} must be finite (got {value!r})"
    elif rule.integer and isinstance(value, float) and value != int(value):
        problem = f"{where} must be an integer (got {value!r})"
    elif value < rule.low or value > rule.high or (rule.low_open and value == rule.low):
        problem = f"{where} is out of range (got {value!r})"
    if problem is not None:
        raise fail(
            problem,
            f"{rule.why}, and it accepts {rule.text()}",
            f"Send {where} as {rule.text()}, or leave it out.",
            param=where,
        )
    assert isinstance(value, int | float)
    return int(value) if rule.integer else value


def optional_int(body: JSON, key: str, where: str | None = None, rule: Range | None = None) -> int | None:
    """``body[key]`` as a token count (an integer >= 1), None when absent."""
    value = body.get(key)
    if value is None:
        return None
    return int(check_number(value, where or key, rule or RANGES["max_tokens"]))


def optional_number(
    body: JSON, key: str, where: str | None = None, rule: Range | None = None
) -> float | None:
    """``body[key]`` checked against ``rule`` (default: the chat field's own range)."""
    value = body.get(key)
    if value is None:
        return None
    rule = rule or RANGES.get(key) or Range(-1e300, 1e300, False, "it is a sampling parameter")
    return check_number(value, where or key, rule)


def check_n(value: object, where: str) -> None:
    if value is None or value == 1:
        return
    raise fail(
        f"{where}={value!r} is not supported",
        "the capture proxy records exactly one sample per model call",
        f"Send {where}=1 (or leave it out) and make several calls instead.",
        param=where,
    )


def nonempty_list(value: object, where: str, why: str, fix: str) -> list[object]:
    items = require_list(value, where)
    if not items:
        raise fail(f"{where} is empty", why, fix, param=where)
    return items


def sampling_fields(body: JSON, keys: tuple[str, ...], ranges: dict[str, Range] | None = None) -> JSON:
    """The numeric sampling fields of ``keys`` the agent set, checked against their ranges."""
    ranges = ranges or {}
    return {key: body[key] for key in keys if optional_number(body, key, rule=ranges.get(key)) is not None}


def canonical_request(out: JSON, body: JSON, notes: list[str], state: JSON) -> CanonicalRequest:
    """The request for the engine, streamed when the body's ``stream`` says so, for its ``model``."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise fail(
            f"stream must be a boolean (got {type_name(stream)})",
            "it selects SSE or JSON",
            "Send stream: true or false.",
            param="stream",
        )
    model = body.get("model")
    return CanonicalRequest(
        body=out,
        stream=bool(stream),
        model=model if isinstance(model, str) else None,
        notes=notes,
        state=state,
    )


def stable_id(prefix: str, *parts: object) -> str:
    """A deterministic id from content (no clocks, no randomness)."""
    digest = hashlib.sha256(
        json.dumps(parts, sort_keys=True, ensure_ascii=False, default=str).encode()
    ).hexdigest()
    return f"{prefix}{digest[:24]}"


def thinking_signature(text: str) -> str:
    """Synthetic, deterministic signature for a thinking block: ours, recognisable, content-derived."""
    return SIG_PREFIX + hashlib.sha256(text.encode()).hexdigest()


def encode_reasoning(text: str) -> str:
    """Opaque ``encrypted_content`` that carries the reasoning text itself, so it round-trips."""
    return SIG_PREFIX + base64.b64encode(text.encode()).decode()


def decode_reasoning(blob: object) -> str | None:
    """The reasoning text inside our own ``encode_reasoning`` blob; None for anyone else's."""
    if not isinstance(blob, str) or not blob.startswith(SIG_PREFIX):
        return None
    try:
        return base64.b64decode(blob[len(SIG_PREFIX) :], validate=True).decode()
    except ValueError:
        return None
