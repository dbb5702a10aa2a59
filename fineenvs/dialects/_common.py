"""Small helpers the four format modules share: reading the engine's completion, usage, ids,
reasoning signatures, message normalisation and SSE framing.

What is covered: the pieces that are identical across formats (the engine side is always one
OpenAI chat completion). What is not covered: anything format-specific; that lives in the format's
own module, even when it looks similar (duplicate glue, share contracts).
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar, TypeVar

from fineenvs.dialects.base import JSON, CanonicalRequest, DialectError

T = TypeVar("T")

ERROR_PREFIX = "fineenvs proxy: "
# Our own prefix for synthetic signatures / encrypted reasoning, so we can tell ours from a real
# provider's opaque blob (which we cannot read) when a client sends history back.
SIG_PREFIX = "fe:"
# Every SSE parser skips comment lines, so a keep-alive can never be taken for the format's first
# event (Anthropic's stream must open with message_start, Responses' with response.created).
SSE_COMMENT_KEEPALIVE = b": keep-alive\n\n"


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


# ---------------------------------------------------------------------------------------------
# The request side: what every format's ``to_canonical`` reads the same way


def nonempty_list(value: object, where: str, why: str, fix: str) -> list[object]:
    items = require_list(value, where)
    if not items:
        raise fail(f"{where} is empty", why, fix, param=where)
    return items


def sampling_fields(body: JSON, keys: tuple[str, ...], ranges: dict[str, Range] | None = None) -> JSON:
    """The numeric sampling fields of ``keys`` the agent set, checked against their ranges."""
    ranges = ranges or {}
    return {key: body[key] for key in keys if optional_number(body, key, rule=ranges.get(key)) is not None}


def json_schema_format(name: str, schema: object) -> JSON:
    """The chat ``response_format`` that asks for JSON matching ``schema``."""
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


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


def dumps_args(value: object) -> str:
    """Tool-call arguments as the JSON string chat completions carries (key order kept: prefix stability).

    None (a call sent without arguments) is the empty object.
    """
    return json.dumps(value if value is not None else {}, ensure_ascii=False)


def loads_args(arguments: str) -> JSON:
    """Tool-call arguments as an object for formats that carry objects; non-JSON is kept, not lost."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return {"raw_arguments": arguments}
    return value if isinstance(value, dict) else {"value": value}


def arguments_json(value: object) -> str:
    """Tool-call arguments sent as a string or an object, as the JSON string chat carries."""
    return value if isinstance(value, str) else dumps_args(value)


def tool_call(call_id: str, name: str, arguments: str) -> JSON:
    """One canonical (chat) tool call."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def sse_data(payload: JSON, end: bytes = b"\n\n") -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + end


def sse_event(event: str, payload: JSON) -> bytes:
    return f"event: {event}\n".encode() + sse_data(payload)


def typed_event(kind: str, **fields: object) -> bytes:
    """A named SSE event whose payload repeats its name as ``type`` (Anthropic's and Responses' shape)."""
    return sse_event(kind, {"type": kind, **fields})


# ---------------------------------------------------------------------------------------------
# The engine's completion


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass
class Usage:
    prompt: int
    completion: int
    cached: int
    reasoning: int

    @property
    def total(self) -> int:
        return self.prompt + self.completion


@dataclass
class Reply:
    """The parts of the engine's one choice that every format needs."""

    id: str
    created: int
    content: str
    reasoning: str
    tool_calls: list[ToolCall]
    finish_reason: str
    usage: Usage


def _int(value: object) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


def read_completion(completion: JSON) -> Reply:
    """Parse the engine's chat completion; a malformed one is the engine's fault (502)."""
    choices = completion.get("choices") if isinstance(completion, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise DialectError(
            prefixed("the engine's completion has no choices[0]; cannot build a reply"), status=502
        )
    choice = choices[0]
    message = as_dict(choice.get("message"))
    content = message.get("content")
    if isinstance(content, list):  # some servers return parts
        content = "".join(as_str(p.get("text")) for p in content if isinstance(p, dict))
    reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
    calls: list[ToolCall] = []
    raw_calls = message.get("tool_calls") or []
    if not isinstance(raw_calls, list):
        raise DialectError(
            prefixed("the engine's tool_calls is not a list; cannot build a reply"), status=502
        )
    for i, call in enumerate(raw_calls):
        if not isinstance(call, dict):
            continue
        fn = as_dict(call.get("function"))
        name = as_str(fn.get("name"))
        args = arguments_json(fn.get("arguments"))
        call_id = as_str(call.get("id")) or stable_id("call_", completion.get("id"), i, name, args)
        calls.append(ToolCall(call_id, name, args))
    raw_usage = as_dict(completion.get("usage"))
    prompt_details = as_dict(raw_usage.get("prompt_tokens_details"))
    completion_details = as_dict(raw_usage.get("completion_tokens_details"))
    usage = Usage(
        prompt=_int(raw_usage.get("prompt_tokens")),
        completion=_int(raw_usage.get("completion_tokens")),
        cached=_int(prompt_details.get("cached_tokens") if isinstance(prompt_details, dict) else 0),
        reasoning=_int(
            completion_details.get("reasoning_tokens") if isinstance(completion_details, dict) else 0
        ),
    )
    finish = choice.get("finish_reason")
    if not isinstance(finish, str) or not finish:
        finish = "tool_calls" if calls else "stop"
    cid = completion.get("id")
    return Reply(
        id=cid if isinstance(cid, str) and cid else stable_id("chatcmpl-", content, reasoning),
        created=_int(completion.get("created")),
        content=content if isinstance(content, str) else "",
        reasoning=reasoning if isinstance(reasoning, str) else "",
        tool_calls=calls,
        finish_reason=finish,
        usage=usage,
    )


def stop_completion(text: str, *, completion_id: str | None = None) -> JSON:
    """A finished chat completion carrying the proxy's own text (budget spent, context full).

    Every format's ``stop_reply`` and ``stream_events`` accept it like an engine completion; it
    carries no token ids, so nothing downstream can mistake it for training data.
    """
    if not text:
        raise ValueError("a stop reply must be non-empty: agents treat an empty reply as an error and retry")
    return {
        "id": completion_id or stable_id("chatcmpl-stop-", text),
        "object": "chat.completion",
        "created": 0,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    }


# ---------------------------------------------------------------------------------------------
# Canonical messages


def join_text(parts: list[str]) -> str:
    # Text blocks of one message become one string (chat templates render strings best); the
    # separator is fixed so that the same history always gives the same canonical text.
    return "\n".join(parts)


def text_part(text: str) -> JSON:
    return {"type": "text", "text": text}


def image_part(url: str) -> JSON:
    return {"type": "image_url", "image_url": {"url": url}}


def text_or_parts(parts: list[JSON]) -> str | list[JSON]:
    """Text-only part lists become one string (as vLLM does); images keep the part list."""
    if all(p["type"] == "text" for p in parts):
        return join_text([p["text"] for p in parts])
    return parts


def normalise_messages(messages: list[JSON], notes: list[str]) -> list[JSON]:
    """Merge leading system/developer messages into one; later ones become user messages.

    Chat templates (Qwen, LFM) accept a system message only first; moving a mid-conversation
    system message to the top would rewrite the start of the prompt and break prefix linking, so
    it stays in place as a user turn.
    """
    out: list[JSON] = []
    leading: list[str] = []
    seen_other = False
    for msg in messages:
        role = msg.get("role")
        if role in ("system", "developer"):
            text = msg.get("content")
            text = (
                text
                if isinstance(text, str)
                else join_text(
                    [
                        p.get("text", "")
                        for p in text or []
                        if isinstance(p, dict) and isinstance(p.get("text"), str)
                    ]
                )
            )
            if not seen_other:
                leading.append(text)
                continue
            notes.append(
                f"mid-conversation {role} message sent as a user message at canonical position {len(out) + bool(leading)} "
                "(templates take system only first)"
            )
            out.append({"role": "user", "content": text})
            continue
        seen_other = True
        out.append(msg)
    if leading:
        if len(leading) > 1:
            notes.append(f"{len(leading)} leading system/developer messages merged into one system message")
        out.insert(0, {"role": "system", "content": "\n\n".join(leading)})
    return out


def function_tool(name: str, description: object, parameters: object) -> JSON:
    fn: JSON = {"name": name}
    if isinstance(description, str) and description:
        fn["description"] = description
    fn["parameters"] = parameters if isinstance(parameters, dict) else {"type": "object", "properties": {}}
    return {"type": "function", "function": fn}


def finish_tools(body: JSON, tools: list[JSON], notes: list[str]) -> None:
    """Set tools on a canonical body; with no tools, tool_choice/parallel_tool_calls go too.

    vLLM rejects tool_choice without tools (kimi-cli sends ``tools: []``; codex sends
    ``parallel_tool_calls`` without tools).
    """
    if tools:
        body["tools"] = tools
        return
    body.pop("tools", None)
    for key in ("tool_choice", "parallel_tool_calls"):
        if key in body:
            body.pop(key)
            notes.append(f"{key} dropped: the request has no tools the engine can call")


# ---------------------------------------------------------------------------------------------
# What every format answers alike


class DialectBase:
    """What the four formats do alike around their own conversions.

    A format subclasses this and writes ``convert`` (its request as a canonical one) and
    ``from_chat_completion`` (its reply). The request body must be an object with at most one
    sample asked for. The proxy's own stop reply is the format's reply to ``stop_completion(text)``,
    and the keep-alive is an SSE comment: every SSE parser skips comment lines, and the keep-alives
    go out before the format's first event (the reply is replayed once the engine is done), where
    Anthropic's stream must open with ``message_start`` and Responses' with ``response.created``.
    Gemini's keep-alive serves its ``alt=sse`` streams (every harness uses them); a plain
    JSON-array stream takes no comments.
    """

    # The body field that asks for several samples (Gemini's sits inside generationConfig).
    samples_field: str | None = "n"
    # The format's error name for an HTTP status: from its table, else its generic server or
    # client name (``error_body``'s ``kind`` overrides it).
    error_names: ClassVar[dict[int, str]] = {}
    server_error_name = "server_error"
    client_error_name = "invalid_request_error"

    def to_canonical(
        self, body: JSON, *, path: str = "", query: dict[str, str] | None = None
    ) -> CanonicalRequest:
        body = require_dict(body, "request body")
        if self.samples_field is not None:
            check_n(body.get(self.samples_field), self.samples_field)
        return self.convert(body, [], path, query or {})

    def convert(self, body: JSON, notes: list[str], path: str, query: dict[str, str]) -> CanonicalRequest:
        """The canonical request for ``body``; ``notes`` collects the lossy or surprising steps."""
        raise NotImplementedError

    def from_chat_completion(self, completion: JSON, request: CanonicalRequest, *, model: str) -> JSON:
        raise NotImplementedError

    def error_body(self, status: int, message: str, *, kind: str | None = None) -> JSON:
        kind = kind or by_status(
            self.error_names, status, server=self.server_error_name, client=self.client_error_name
        )
        return self.error_object(status, prefixed(message), kind)

    def error_object(self, status: int, message: str, kind: str) -> JSON:
        """The format's error body for ``message`` (already prefixed) of the error name ``kind``."""
        raise NotImplementedError

    def stop_reply(self, text: str, request: CanonicalRequest, *, model: str) -> JSON:
        return self.from_chat_completion(stop_completion(text), request, model=model)

    def keepalive(self) -> bytes:
        return SSE_COMMENT_KEEPALIVE
