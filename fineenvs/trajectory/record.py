"""The call record: what the capture proxy stores for each model call, and how it becomes a node.

One type for the project's most important contract. The proxy's store writes it
(``fineenvs.proxy.store.CallStore.encode_call``, one JSON line per call, prompts delta-encoded on
disk) and gives it back whole from ``read_session``; the control plane sends it over HTTP
(``GET /sessions/{id}/rollout``); the attempt runner, the SFT dataset builder, the exporters and
the evaluation read it. ``calls_to_nodes`` is the one conversion into trajectory nodes.

The records are JSON, so these are ``TypedDict`` views of plain dicts: reading a key that a
record of this schema does not have is a type error, and the data stays what the store wrote.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict

from fineenvs.jsonl import JsonObject
from fineenvs.trajectory.node import CallNode

CALL_SCHEMA_VERSION = 1
"""Version of the call and event lines the store writes (``schema_version`` in each)."""


class RecordedRequest(TypedDict):
    """The agent's request as the proxy saw it, in the canonical (OpenAI Chat) form."""

    messages: list[JsonObject]
    """The full message list sent for this call (rebuilt from the delta-encoded log on read)."""
    tools_digest: str | None
    tools: NotRequired[Any]
    """The tool manifest (``None`` if its first record was lost to a failed write)."""


class CallTimings(TypedDict):
    arrived_at: float
    upstream_s: float
    attempts: int
    proxy_s: float


class CallRecord(TypedDict):
    """One recorded model call, as ``CallStore.read_session`` returns it."""

    type: Literal["call"]
    schema_version: int
    call_id: str
    """``c00000``, ``c00001``, ...: the call's place in the session."""
    session_id: str
    index: int
    prompt_ids: list[int]
    """Exactly the token ids the engine was given (its own ``prompt_token_ids``)."""
    sampled_ids: list[int]
    """Exactly the token ids the engine sampled."""
    logprobs: list[float] | None
    """The engine's logprob of each sampled token; None when it returned none."""
    logprobs_aligned: bool
    """One logprob per sampled token, for these very tokens: the call is trainable."""
    finish_reason: str | None
    weight_version: int | None
    """The policy version that sampled the call (the engine's own record, when it keeps one)."""
    weight_versions: list[JsonObject] | None
    usage: JsonObject | None
    request: RecordedRequest
    response: JsonObject
    """The assistant message the agent received (canonical form)."""
    dialect: str
    """The API format the agent spoke (``openai_chat``, ``anthropic_messages``, ...)."""
    stream: bool
    model_requested: str | None
    served_model: str
    has_tools: bool
    sampling_requested: JsonObject
    sampling_applied: JsonObject
    max_tokens_requested: int | None
    max_tokens_applied: int
    request_params: JsonObject
    dialect_state: Any
    harness_ids: JsonObject
    """Ids the harness sent about itself (session, subagent): recorded, never routed on."""
    notes: list[str]
    constrained: bool
    """Sampled under a requested output format (grammar): not the policy's own distribution."""
    requested_format: Any
    timings: CallTimings
    replica: NotRequired[str | None]
    """The server that sampled the call when several serve behind a router (its name, from the
    ``x-fineenvs-replica`` header it stamps); None or absent with one server."""


class EventRecord(TypedDict):
    """A counted event that is not a model call (budget stop, context stop, upstream error)."""

    type: Literal["event"]
    schema_version: int
    kind: str
    index: int | None
    at: float


class SessionLog(TypedDict):
    """A whole session: ``CallStore.read_session``'s answer and the rollout route's body."""

    meta: JsonObject | None
    calls: list[CallRecord]
    events: list[EventRecord]


def calls_to_nodes(calls: list[CallRecord]) -> list[CallNode]:
    """Recorded calls as trajectory nodes.

    A call whose logprobs were missing or misaligned, or that has no prompt ids, is context only.
    """
    return [
        CallNode(
            node_id=c["call_id"],
            prompt_ids=list(c["prompt_ids"]),
            sampled_ids=list(c["sampled_ids"]),
            logprobs=c.get("logprobs"),
            finish_reason=c.get("finish_reason"),
            has_tools=bool(c.get("has_tools")),
            arrival_index=int(c.get("index", i)),
            weight_version=c.get("weight_version"),
            harness_ids={k: str(v) for k, v in (c.get("harness_ids") or {}).items()},
            metadata={"dialect": c.get("dialect"), "notes": c.get("notes", [])},
            logprobs_aligned=bool(c.get("logprobs_aligned")) and bool(c["prompt_ids"]),
            constrained=bool(c.get("constrained")),
        )
        for i, c in enumerate(calls)
    ]
