"""The reply side every format shares: the engine's completion read once, the proxy's own stop
completion, SSE framing, and ``DialectBase`` (what the four formats do alike around their own
conversions).

What is covered: the engine side is always one OpenAI chat completion, read here into ``Reply``.
What is not covered: a format's reply shape (its module).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar

from fineenvs.dialects._common import (
    as_dict,
    as_str,
    by_status,
    check_n,
    prefixed,
    require_dict,
    stable_id,
)
from fineenvs.dialects.base import JSON, CanonicalRequest, DialectError
from fineenvs.dialects.canonical import arguments_json

# Every SSE parser skips comment lines, so a keep-alive can never be taken for the format's first
# event (Anthropic's stream must open with message_start, Responses' with response.created).
SSE_COMMENT_KEEPALIVE = b": keep-alive\n\n"


def sse_data(payload: JSON, end: bytes = b"\n\n") -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + end


def sse_event(event: str, payload: JSON) -> bytes:
    return f"event: {event}\n".encode() + sse_data(payload)


def typed_event(kind: str, **fields: object) -> bytes:
    """A named SSE event whose payload repeats its name as ``type`` (Anthropic's and Responses' shape)."""
    return sse_event(kind, {"type": kind, **fields})


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
