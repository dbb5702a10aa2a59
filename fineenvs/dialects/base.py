"""The contract every wire-format module in ``fineenvs.dialects`` implements.

The proxy is hub and spoke: each agent-facing format converts its request into one canonical
OpenAI Chat Completions request (what the engine speaks), and converts the engine's finished chat
completion back into its own response body or its own SSE event sequence. Modules are pure
functions over dicts: no I/O, no clocks, no randomness (ids derive from the content).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

JSON = dict[str, Any]


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


class DialectError(ValueError):
    """The agent's request cannot be converted; the message says what, why and how to fix it."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


class Dialect(Protocol):
    """One agent-facing API format (``openai_chat``, ``openai_responses``, ``anthropic_messages``, ``gemini``)."""

    name: str

    def to_canonical(self, body: JSON, *, path: str, query: dict[str, str]) -> CanonicalRequest: ...

    def from_chat_completion(self, completion: JSON, request: CanonicalRequest, *, model: str) -> JSON: ...

    def stream_events(self, completion: JSON, request: CanonicalRequest, *, model: str) -> Iterator[bytes]: ...

    def error_body(self, status: int, message: str, *, kind: str = "invalid_request_error") -> JSON: ...
