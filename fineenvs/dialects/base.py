"""The contract every wire-format module in ``fineenvs.dialects`` implements.

The proxy is hub and spoke: each agent-facing format converts its request into one canonical
OpenAI Chat Completions request (what the engine speaks), and converts the engine's finished chat
completion back into its own response body or its own SSE event sequence. Modules are pure
functions over dicts: no I/O, no clocks, no randomness (ids derive from the content).

What is covered: the request side (``to_canonical``), the reply side for a finished engine
completion (``from_chat_completion``, ``stream_events``), the format's error bodies, the proxy's own
stop replies and stream keep-alives. What is not covered: HTTP, sessions, sampling policy and the
engine call (``fineenvs.proxy``); a module never sees token ids except to leave them out of replies.

Canonical conventions: assistant history carries prior reasoning as ``reasoning_content`` (the
proxy renames it for the engine if needed); tool arguments are JSON strings; text-only content is a
string (parts joined with a newline); images stay ``image_url`` parts.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from fineenvs.jsonl import JsonObject

# The dialects' short name for a parsed JSON object (a request body, a message, a completion).
JSON = JsonObject


@dataclass
class CanonicalRequest:
    """A chat-completions request for the engine, plus what the conversion noticed.

    ``body`` holds ``messages``, ``tools``, ``tool_choice``, ``max_tokens`` and the sampling fields
    the agent asked for (the proxy later overrides sampling with the configured policy and records
    both). ``notes`` lists lossy or surprising steps (a dropped server-side tool, a stripped nonce
    line) so they can be recorded with the call.
    """

    body: JSON
    stream: bool = False
    model: str | None = None
    notes: list[str] = field(default_factory=list)
    # Dialect-private facts the response side needs (flattened tool names, include_usage, the
    # Responses echo fields). JSON-serialisable, so the proxy can record it with the call.
    state: JSON = field(default_factory=dict)


class DialectError(ValueError):
    """The agent's request cannot be converted; the message says what, why and how to fix it.

    ``status`` is the HTTP status to answer with (400 for the agent's mistakes; 502 when the
    engine's completion itself is unusable).
    """

    def __init__(self, message: str, *, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


class Dialect(Protocol):
    """One agent-facing API format (``openai_chat``, ``openai_responses``, ``anthropic_messages``, ``gemini``)."""

    name: str

    def to_canonical(self, body: JSON, *, path: str, query: dict[str, str]) -> CanonicalRequest: ...

    def from_chat_completion(self, completion: JSON, request: CanonicalRequest, *, model: str) -> JSON: ...

    def stream_events(
        self, completion: JSON, request: CanonicalRequest, *, model: str
    ) -> Iterator[bytes]: ...

    def error_body(self, status: int, message: str, *, kind: str | None = None) -> JSON:
        """The format's own error body; ``kind`` defaults to the format's name for ``status``."""
        ...

    def stop_reply(self, text: str, request: CanonicalRequest, *, model: str) -> JSON:
        """A finished, non-empty reply the proxy sends on its own (budget spent, context full).

        Stream it with ``stream_events(stop_completion(text), ...)`` when the caller streams.
        """
        ...

    def keepalive(self) -> bytes:
        """Bytes the format's clients ignore, sent on an open stream while the engine works."""
        ...
