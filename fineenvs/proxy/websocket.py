"""The OpenAI Responses WebSocket transport: Codex's default with its built-in ``openai`` provider.

Protocol (``codex-rs`` ``codex-api/src/endpoint/responses_websocket.rs`` and ``core/src/client.rs``,
checked against codex 0.171.0 on the wire):

* The client upgrades ``GET /v1/responses`` (here also under ``/s/<key>``) with
  ``Authorization: Bearer <key>`` and ``openai-beta: responses_websockets=2026-02-06``, offering
  permessage-deflate. One connection carries the turns of a conversation, one request at a time.
* Each request is one text frame ``{"type": "response.create", ...}`` holding a Responses body.
  ``generate: false`` is a warm-up: answered with ``response.created`` and ``response.completed``
  of an empty response, no model call. ``previous_response_id`` names the connection's last
  response; ``input`` then holds only the new items, and the full input is that response's input,
  its output items and the new items (the client sends the delta only when that holds).
* The server answers with the Responses stream events, one JSON object per text frame, ending with
  ``response.completed`` (or ``response.incomplete``). A failure is one frame
  ``{"type": "error", "status": N, "error": {...}}``, which the client treats as that HTTP status.
* ``{"type": "response.processed", "response_id": ...}`` acknowledgements need no answer.

A request takes exactly the HTTP route's path: the same parse, session lookup, conversion,
budget, engine call, durable record (with ``transport: websocket``) and reply events. The frames
come from the Starlette/uvicorn WebSocket implementation (``websockets`` underneath), not a
parser of our own.

What is not covered: events before the engine has answered (the reply is sent as a whole once
the call is recorded, as on HTTP; uvicorn's pings keep the connection alive meanwhile),
``response.append`` frames of older clients, several requests in flight on one connection.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass, field

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from fineenvs.dialects import DIALECTS, DialectError, stop_completion
from fineenvs.dialects.base import CanonicalRequest, Dialect
from fineenvs.jsonl import JsonObject
from fineenvs.proxy.calls import CallHost, Outcome, PreparedCall, no_session_message, split_session_prefix
from fineenvs.proxy.wire import bearer, json_response

log = logging.getLogger("fineenvs.proxy.websocket")
DIALECT = "openai_responses"
PATHS = ("/v1/responses", "/responses")


@dataclass
class Conversation:
    """What ``previous_response_id`` refers to: the connection's last response and its input."""

    response_id: str | None = None
    input: list[object] = field(default_factory=list)
    output: list[object] = field(default_factory=list)


class FrameError(Exception):
    """A request frame the proxy answers with an error frame (the connection stays open)."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def _dialect() -> Dialect:
    return DIALECTS[DIALECT]


def error_frame(status: int, message: str, code: str | None = None) -> JsonObject:
    """An error in the Responses format, wrapped as the WebSocket transport sends it."""
    body = _dialect().error_body(status, message)
    if code is not None:
        body["error"]["code"] = code
    return {"type": "error", "status": status, **body}


def sse_payloads(chunks: list[bytes]) -> list[JsonObject]:
    """The JSON objects of a Responses SSE stream (one per ``data:`` line)."""
    out: list[JsonObject] = []
    for line in b"".join(chunks).split(b"\n"):
        if line.startswith(b"data: "):
            out.append(orjson.loads(line[len(b"data: ") :]))
    return out


def expand(body: JsonObject, conv: Conversation) -> JsonObject:
    """The request with ``previous_response_id`` resolved into the full input (or a FrameError)."""
    new_input = body.get("input")
    if isinstance(new_input, str):
        new_input = [{"type": "message", "role": "user", "content": new_input}]
    if not isinstance(new_input, list):
        raise FrameError(400, "input must be a list of items (or a string).")
    previous = body.pop("previous_response_id", None)
    if previous is None:
        return {**body, "input": new_input}
    if previous != conv.response_id:
        raise FrameError(
            400,
            f"previous_response_id {previous!r} is not this connection's last response "
            f"({conv.response_id!r}): the proxy keeps only that one. Send the full input without "
            "previous_response_id, or reconnect.",
            code="previous_response_not_found",
        )
    return {**body, "input": [*conv.input, *conv.output, *new_input]}


def warmup_events(body: JsonObject, model: str) -> list[JsonObject]:
    """``response.created`` + ``response.completed`` of an empty response (``generate: false``).

    The Response object is the dialect's own (echoing the request's settings), with no output.
    """
    dialect = _dialect()
    try:
        canonical = dialect.to_canonical(dict(body), path="/v1/responses", query={})
    except DialectError as exc:
        raise FrameError(exc.status, str(exc)) from None
    done = dialect.from_chat_completion(
        stop_completion("warm-up", completion_id=f"warmup-{secrets.token_hex(8)}"),
        canonical,
        model=canonical.model or model,
    )
    done["output"] = []  # the usage is the stop completion's: all zero
    pending = {**done, "status": "in_progress", "usage": None}
    return [
        {"type": "response.created", "sequence_number": 0, "response": pending},
        {"type": "response.completed", "sequence_number": 1, "response": done},
    ]


class ResponsesSocket:
    """One accepted connection: frames in, event frames out, one request at a time."""

    def __init__(self, proxy: CallHost, ws: WebSocket, path: str, path_key: str | None) -> None:
        self.proxy = proxy
        self.ws = ws
        self.path = path
        self.path_key = path_key
        self.conv = Conversation()
        # The HTTP request the upgrade was: the call goes through the HTTP route's own
        # parse/authenticate/convert step, which reads headers and query from it.
        self.request = Request({**ws.scope, "type": "http", "method": "POST"})

    async def run(self) -> None:
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            raw = message.get("text")
            raw_bytes = raw.encode() if isinstance(raw, str) else message.get("bytes") or b""
            self.proxy.inflight += 1  # a request, as on HTTP; an idle connection is not one
            try:
                frames = await self.handle(raw_bytes)
            except FrameError as exc:
                frames = [error_frame(exc.status, exc.message, exc.code)]
            finally:
                self.proxy.inflight -= 1
            for frame in frames:
                await self.ws.send_text(orjson.dumps(frame).decode())

    async def handle(self, raw: bytes) -> list[JsonObject]:
        try:
            frame = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise FrameError(400, f"frame is not valid JSON ({exc}). Send a JSON object.") from None
        if not isinstance(frame, dict):
            raise FrameError(400, f"frame must be a JSON object, got {type(frame).__name__}.")
        kind = frame.pop("type", None)
        if kind == "response.processed":
            return []
        if kind != "response.create":
            raise FrameError(400, f"unsupported frame type {kind!r}: send response.create frames.")
        body = expand(frame, self.conv)
        warmup = body.pop("generate", None) is False
        body["stream"] = True  # every answer here is a stream of events
        if warmup:
            self.proxy.aux_calls += 1
            events = warmup_events(body, self.proxy.settings.served_model)
            self._remember(events, body["input"])
            return events
        raw_body = orjson.dumps(body)
        limit = self.proxy.settings.max_body_bytes
        async with self.proxy.cpu_turn:
            prepared = self.proxy.prepare_call(
                self.request, self.path, self.path_key, raw_body if len(raw_body) <= limit else None
            )
        if isinstance(prepared, Response):
            # An error of the HTTP route: the same status and body, as an error frame.
            return [{"type": "error", "status": prepared.status_code, **orjson.loads(bytes(prepared.body))}]
        events = await self._call(prepared)
        self._remember(events, body["input"])
        return events

    async def _call(self, prepared: PreparedCall) -> list[JsonObject]:
        proxy = self.proxy
        prepared.fields["transport"] = "websocket"
        canonical = prepared.reply_request
        model = canonical.model or proxy.settings.served_model
        task = await proxy.start_call(prepared)
        if isinstance(task, Outcome):
            return self._events(task, canonical, model)
        outcome = await asyncio.shield(task)
        async with proxy.cpu_turn:
            return self._events(outcome, canonical, model)

    def _events(self, outcome: Outcome, canonical: CanonicalRequest, model: str) -> list[JsonObject]:
        if outcome.kind == "error" or outcome.completion is None:
            return [error_frame(outcome.status, outcome.message)]
        return sse_payloads(list(_dialect().stream_events(outcome.completion, canonical, model=model)))

    def _remember(self, events: list[JsonObject], full_input: list[object]) -> None:
        final = events[-1] if events else {}
        response = final.get("response")
        if final.get("type") in ("response.completed", "response.incomplete") and isinstance(response, dict):
            self.conv = Conversation(response.get("id"), full_input, list(response.get("output") or []))


async def serve_websocket(proxy: CallHost, scope: Scope, receive: Receive, send: Send) -> None:
    """ASGI entry for every WebSocket upgrade the proxy receives."""
    ws = WebSocket(scope, receive, send)
    path_key, path = split_session_prefix(scope["path"])
    if path.rstrip("/") not in PATHS:
        await _deny(ws, 404, f"no WebSocket route {path}: the proxy serves only /v1/responses.")
        return
    headers = ws.headers
    key = path_key or bearer(headers) or headers.get("x-api-key")
    if not key or proxy.sessions.lookup(key) is None:
        await _deny(ws, 401, no_session_message(key))
        return
    await ws.accept()
    try:
        await ResponsesSocket(proxy, ws, path, path_key).run()
    except (WebSocketDisconnect, OSError, RuntimeError):
        pass  # the client went away; a call it was waiting for is recorded all the same
    finally:
        if ws.application_state == WebSocketState.CONNECTED and ws.client_state == WebSocketState.CONNECTED:
            try:
                await ws.close()
            except RuntimeError:  # the client went away first
                pass


async def _deny(ws: WebSocket, status: int, message: str) -> None:
    """Refuse the upgrade with an HTTP status and a Responses error body (a plain close without the
    ASGI denial-response extension)."""
    if "websocket.http.response" in ws.scope.get("extensions", {}):
        await ws.send_denial_response(json_response(_dialect().error_body(status, message), status))
    else:
        await ws.close(code=1008, reason=message[:120])
