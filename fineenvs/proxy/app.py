"""The capture proxy: agent-facing model routes in four formats, the control plane and /health.

What is covered: model calls on every format's paths, with or without a ``/s/<key>`` prefix;
session lookup by path key or API key (``Authorization: Bearer``, ``x-api-key``,
``x-goog-api-key``, Gemini's ``?key=``), 401 in the caller's own format for unknown keys;
harness-sent session ids recorded per call and never used for routing; the per-session model-call
budget and context overflow answered with a valid, non-empty stop reply (streamed when asked);
body size limit (413) and JSON errors (400) in the caller's format; auxiliary routes answered and
never recorded; streaming replies with keep-alives while the engine works; every recorded call
flushed to disk before its reply is sent, by a task that a client disconnect cannot cancel.
Sessions sharded over several processes: ``fineenvs.proxy.workers`` (``serve --workers N``).

The Responses WebSocket transport (codex's default) is :mod:`fineenvs.proxy.websocket`.

What is not covered: per-session engines, TLS (bind loopback or put a TLS terminator in front).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx
import orjson
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from fineenvs.dialects import DIALECTS, DialectError, aux_response, aux_route, detect, stop_completion
from fineenvs.dialects.base import CanonicalRequest, Dialect
from fineenvs.jsonl import JsonObject
from fineenvs.proxy.calls import (
    BUDGET_TEXT,
    CpuTurn,
    Outcome,
    PreparedCall,
    no_session_message,
    split_session_prefix,
)
from fineenvs.proxy.control import ControlPlane
from fineenvs.proxy.engine_client import EngineClient, HttpxEngine, RawEngine
from fineenvs.proxy.sessions import Session, SessionRegistry
from fineenvs.proxy.settings import ProxySettings
from fineenvs.proxy.store import CallStore, StoreError
from fineenvs.proxy.upstream import (
    BadRequest,
    EngineRequest,
    EngineResult,
    UpstreamError,
    VersionBracket,
    build_engine_request,
    call_seed,
    decode_reply,
    post_with_retries,
    with_seed,
)
from fineenvs.proxy.websocket import serve_websocket
from fineenvs.proxy.wire import bearer, json_response

log = logging.getLogger("fineenvs.proxy")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Connection": "keep-alive"}
# Ids harnesses send about themselves: recorded per call (subagent attribution), never routed on.
HARNESS_ID_HEADERS = (
    "x-session-id",
    "proxy-x-session-id",
    "x-claude-code-session-id",
    "session-id",
    "thread-id",
    "x-openai-subagent",
    "x-client-request-id",
    "x-request-id",
    "user-agent",
)
# Requests doing CPU work (parse/convert, decode/record, reply) per event-loop iteration. 8
# gave /health p99 of 72-174 ms with 1,000 sessions bursting on a loaded 2-core box, 2 gave
# 62-82 ms with the same throughput: the total work is the same, only its slicing changes.
CPU_SLOTS = 2
# Model-call bodies being read and converted at once (the rest wait, unread, before that).
INTAKE_SLOTS = 64
CONTEXT_TEXT = (
    "fineenvs proxy: the conversation no longer fits in the model's context window. "
    "Stop here: no further actions will be run."
)


_HARNESS_ID_SET = frozenset(HARNESS_ID_HEADERS)


def _harness_ids(raw_headers: list[tuple[bytes, bytes]], body: JsonObject) -> dict[str, str]:
    # One pass over the raw ASGI headers (names arrive lower-cased); the first value wins, as in
    # Starlette's Headers, whose lookups would scan the list once per name.
    ids: dict[str, str] = {}
    for raw_name, raw_value in raw_headers:
        name = raw_name.decode("latin-1")
        if name in _HARNESS_ID_SET and name not in ids:
            ids[name] = raw_value.decode("latin-1")
    for key in ("user", "_session_id", "prompt_cache_key"):
        if isinstance(body.get(key), str):
            ids[f"body.{key}"] = body[key]
    meta = body.get("metadata")
    if isinstance(meta, dict) and isinstance(meta.get("user_id"), str):
        ids["body.metadata.user_id"] = meta["user_id"]
    return ids


class ProxyApp:
    """Request handlers; ``create_proxy_app`` wraps them in a Starlette app."""

    def __init__(
        self,
        settings: ProxySettings,
        upstream: EngineClient,
        store: CallStore,
        *,
        shard: tuple[int, int] = (0, 1),
    ) -> None:
        self.settings = settings
        self.upstream = upstream
        self.versions = VersionBracket(upstream, settings)
        self.store = store
        self.shard = shard
        self.sessions = SessionRegistry(store, settings.max_model_calls, shard=shard)
        self.started = time.time()
        self.inflight = 0
        self.tasks: set[asyncio.Task[Outcome]] = set()
        self.aux_calls = 0
        self.upstream_slots = asyncio.Semaphore(settings.max_upstream_concurrency)
        self.cpu_turn = CpuTurn(CPU_SLOTS)
        self.intake_slots = asyncio.Semaphore(INTAKE_SLOTS)

    # -- helpers -------------------------------------------------------------------------------

    def _dialect(self, name: str) -> Dialect:
        return DIALECTS.get(name) or DIALECTS["openai_chat"]

    def _error(self, dialect: Dialect, status: int, message: str, kind: str | None = None) -> Response:
        return json_response(dialect.error_body(status, message, kind=kind), status)

    async def _read_body(self, request: Request) -> bytes | None:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return None
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    # -- model calls ---------------------------------------------------------------------------

    async def model_route(self, request: Request) -> Response:
        self.inflight += 1
        try:
            return await self._model_route(request)
        finally:
            self.inflight -= 1

    async def _model_route(self, request: Request) -> Response:
        headers = request.headers
        path_key, path = split_session_prefix(request.scope["path"])
        method = request.method
        aux = aux_route(path, method)
        if aux is not None:
            return await self._aux(request, aux, path)
        if method != "POST":
            dialect = self._dialect(detect(path, headers, None))
            return self._error(dialect, 404, f"no route {method} {path}: model calls are POST requests.")
        # Bodies not yet admitted stay in the kernel's socket buffers (uvicorn stops reading at
        # its high-water mark), not in this process: 320 agents sending 200 KB at once would
        # otherwise hold 64 MB of raw bodies while they wait for a CPU turn.
        async with self.intake_slots:
            try:
                async with asyncio.timeout(self.settings.body_timeout_s):
                    raw = await self._read_body(request)
            except TimeoutError:
                dialect = self._dialect(detect(path, headers, None))
                return self._error(
                    dialect, 408, f"the request body did not arrive within {self.settings.body_timeout_s} s."
                )
            async with self.cpu_turn:
                prepared = self.prepare_call(request, path, path_key, raw)
            del raw  # keep only the converted request while the engine works
        if isinstance(prepared, Response):
            return prepared
        dialect, canonical = prepared.dialect, prepared.reply_request
        reply_model = canonical.model or self.settings.served_model
        task = await self.start_call(prepared)
        if isinstance(task, Outcome):
            return self._reply(dialect, canonical, task, reply_model)
        if canonical.stream:
            return await self._stream(task, dialect, canonical, reply_model)
        outcome = await asyncio.shield(task)
        async with self.cpu_turn:
            return self._reply(dialect, canonical, outcome, reply_model)

    async def start_call(self, prepared: PreparedCall) -> Outcome | asyncio.Task[Outcome]:
        """The task forwarding one call, or the stop reply once the session's budget is spent."""
        session = prepared.session
        session.last_call_at = time.time()
        if session.model_calls >= session.max_model_calls:
            session.budget_stops += 1
            await self.record_event(session, "budget_stop", None, {"model_calls": session.model_calls})
            return Outcome("stop", stop_completion(BUDGET_TEXT.format(n=session.max_model_calls)))
        session.model_calls += 1
        index = session.next_index
        session.next_index += 1
        if session.sampling_seed is not None:
            seed = call_seed(session.sampling_seed, index)
            prepared.payload = with_seed(prepared.payload, seed)
            prepared.fields["sampling_applied"] = {**prepared.fields["sampling_applied"], "seed": seed}
        task = asyncio.create_task(self.forward_call(prepared, index))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def prepare_call(
        self, request: Request, path: str, path_key: str | None, raw: bytes | None
    ) -> Response | PreparedCall:
        """Parse, authenticate and convert one model call (synchronous: no awaits inside)."""
        headers = request.headers
        if raw is None:
            dialect = self._dialect(detect(path, headers, None))
            return self._error(
                dialect,
                413,
                f"request body exceeds the proxy's limit of {self.settings.max_body_bytes} bytes. "
                "Raise --max-body-bytes or shorten the conversation.",
            )
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            dialect = self._dialect(detect(path, headers, None))
            return self._error(dialect, 400, f"request body is not valid JSON ({exc}). Send a JSON object.")
        name = detect(path, headers, body if isinstance(body, dict) else None)
        dialect = self._dialect(name)
        if name not in DIALECTS:
            return self._error(
                dialect, 501, f"the {name} format is not available in this build of the proxy."
            )
        key = path_key or bearer(headers) or headers.get("x-api-key") or headers.get("x-goog-api-key")
        key = key or request.query_params.get("key")
        session = self.sessions.lookup(key) if key else None
        if session is None:
            return self._error(dialect, 401, no_session_message(key), kind="authentication_error")
        if not isinstance(body, dict):
            return self._error(
                dialect, 400, f"request body must be a JSON object, got {type(body).__name__}."
            )
        converted = self._convert(request, path, name, dialect, body)
        if isinstance(converted, Response):
            return converted
        canonical, engine_req, payload = converted
        return self._prepared(request, session, name, dialect, body, canonical, engine_req, payload)

    def _convert(
        self, request: Request, path: str, name: str, dialect: Dialect, body: JsonObject
    ) -> Response | tuple[CanonicalRequest, EngineRequest, bytes]:
        """The call as a canonical request and as the engine's payload, or the caller's error."""
        try:
            canonical = dialect.to_canonical(body, path=path, query=dict(request.query_params))
            engine_req = build_engine_request(canonical.body, self.settings)
            return canonical, engine_req, orjson.dumps(engine_req.body)
        except DialectError as exc:
            return self._error(dialect, exc.status, str(exc))
        except BadRequest as exc:
            return self._error(dialect, 400, str(exc))
        except Exception as exc:  # a converter tripping over odd input is still the caller's 400
            log.warning("conversion of a %s request failed: %s: %s", name, type(exc).__name__, exc)
            return self._error(
                dialect,
                400,
                f"could not read the {name} request ({type(exc).__name__}: {exc}). Check its shape.",
            )

    def _prepared(
        self,
        request: Request,
        session: Session,
        name: str,
        dialect: Dialect,
        body: JsonObject,
        canonical: CanonicalRequest,
        engine_req: EngineRequest,
        payload: bytes,
    ) -> PreparedCall:
        messages = canonical.body.get("messages") or []
        tools = canonical.body.get("tools") or None
        params = {k: v for k, v in canonical.body.items() if k not in ("messages", "tools")}
        # From here on only the engine payload, the record's new suffix and a slim request for
        # the reply stay alive: a 200 KB conversation is several times that as Python objects.
        return PreparedCall(
            session=session,
            dialect_name=name,
            dialect=dialect,
            reply_request=CanonicalRequest(
                body=params, stream=canonical.stream, model=canonical.model, notes=[], state=canonical.state
            ),
            payload=payload,
            record_request=self.store.prepare_request(session.session_id, messages, tools),
            fields={
                "dialect": name,
                "stream": canonical.stream,
                "model_requested": canonical.model,
                "served_model": self.settings.served_model,
                "has_tools": bool(tools),
                "sampling_requested": engine_req.requested_sampling,
                "sampling_applied": engine_req.applied_sampling,
                "max_tokens_requested": engine_req.max_tokens_requested,
                "max_tokens_applied": engine_req.body["max_tokens"],
                "request_params": params,
                "dialect_state": canonical.state,
                "harness_ids": _harness_ids(request.scope["headers"], body),
                "notes": [*canonical.notes, *engine_req.notes],
                "constrained": engine_req.requested_format is not None,
                "requested_format": engine_req.requested_format,
            },
            hide_reasoning=engine_req.hide_reasoning,
        )

    async def _aux(self, request: Request, kind: str, path: str) -> Response:
        self.aux_calls += 1
        if request.method == "HEAD":
            return Response(status_code=200)
        body = None
        if request.method == "POST":
            raw = await self._read_body(request)
            try:
                body = orjson.loads(raw) if raw else None
            except orjson.JSONDecodeError:
                body = None
        try:
            return json_response(
                aux_response(kind, body if isinstance(body, dict) else None, self.settings.served_model)
            )
        except Exception as exc:
            dialect = self._dialect(detect(path, request.headers, None))
            return self._error(dialect, 400, f"could not answer {kind}: {type(exc).__name__}: {exc}")

    async def record_event(self, session: Session, kind: str, index: int | None, fields: JsonObject) -> None:
        event = {"kind": kind, "index": index, "at": time.time(), **fields}
        try:
            await self.store.record_event(session.session_id, event)
        except StoreError as exc:
            log.error("could not record %s event for %s: %s", kind, session.session_id, exc)

    async def forward_call(self, call: PreparedCall, index: int) -> Outcome:
        """Engine call + durable record. Runs as its own task: a disconnecting client cannot cancel it."""
        session = call.session
        arrived = time.time()
        t0 = time.perf_counter()
        session.inflight += 1
        for k, v in call.fields["harness_ids"].items():
            seen = session.harness_ids.setdefault(k, [])
            if v not in seen and len(seen) < 16:
                seen.append(v)
        try:
            try:
                result = await self._ask_engine(call)
            except Exception as exc:  # noqa: BLE001 - any engine-side failure must become a reply
                return await self._engine_failure(session, index, exc)
            fields = {
                "index": index,
                **call.fields,
                "logprobs": result.logprobs,
                "logprobs_aligned": result.logprobs_aligned,
                "finish_reason": result.finish_reason,
                "weight_version": result.weight_version,
                "weight_versions": result.weight_versions,
                "replica": result.replica,
                "usage": result.completion.get("usage"),
                "notes": [*call.fields["notes"], *result.notes],
                "timings": {
                    "arrived_at": arrived,
                    "upstream_s": round(result.upstream_s, 6),
                    "attempts": result.attempts,
                    "proxy_s": round(time.perf_counter() - t0 - result.upstream_s, 6),
                },
            }
            if not await self._record_call(call, index, result, fields):
                return Outcome("error", status=503, message="the proxy could not record this call; retry it.")
            session.recorded_calls += 1
            if not result.logprobs_aligned:
                session.flagged_calls += 1
            if call.hide_reasoning:
                _strip_reasoning(result.completion)
            return Outcome("ok", result.completion)
        finally:
            session.inflight -= 1

    async def _ask_engine(self, call: PreparedCall) -> EngineResult:
        """The engine's decoded reply to ``call``, stamped with the weight versions around it."""
        started = time.perf_counter()
        async with self.upstream_slots:
            version_before = await self.versions.read()
            resp, attempts = await post_with_retries(
                self.upstream, self.settings, call.payload, call.session.session_id
            )
        call.payload = b""  # answered: free it before waiting for a CPU turn
        async with self.cpu_turn:
            result = decode_reply(
                resp,
                attempts=attempts,
                upstream_s=time.perf_counter() - started,
                read_prompt=self.store.prompt_reader(call.session.session_id),
            )
        await self.versions.stamp(result, version_before)
        return result

    async def _engine_failure(self, session: Session, index: int, exc: Exception) -> Outcome:
        """The reply to a failed engine call (a stop on context overflow, else an error), recorded."""
        if not isinstance(exc, UpstreamError):
            log.error("engine call failed unexpectedly", exc_info=exc)
            exc = UpstreamError("unavailable", 502, f"{type(exc).__name__}: {exc}")
        failure = {"status": exc.status, "message": exc.message[:2000], "attempts": exc.attempts}
        if exc.kind == "context_overflow":
            session.context_stops += 1
            await self.record_event(session, "context_stop", index, failure)
            return Outcome("stop", stop_completion(CONTEXT_TEXT))
        if exc.kind == "rejected":
            session.rejected_calls += 1
            await self.record_event(session, "upstream_rejected", index, failure)
            return Outcome(
                "error", status=exc.status, message=f"the engine rejected the request: {exc.message}"
            )
        session.upstream_errors += 1
        await self.record_event(session, "upstream_error", index, failure)
        return Outcome("error", status=502, message=f"engine unavailable: {exc.message}")

    async def _record_call(
        self, call: PreparedCall, index: int, result: EngineResult, fields: JsonObject
    ) -> bool:
        """Write the call's record line; False (logged) when the store could not."""
        session_id = call.session.session_id
        try:
            async with self.cpu_turn:
                line = self.store.encode_call(
                    session_id,
                    f"c{index:05d}",
                    prompt=result.prompt if result.prompt is not None else [],
                    sampled_ids=result.sampled_ids,
                    request=call.record_request,
                    response_message=result.message,
                    fields=fields,
                )
            await self.store.append_line(session_id, line)
        except StoreError as exc:
            log.error("%s", exc)
            return False
        return True

    def _reply(self, dialect: Dialect, canonical: CanonicalRequest, outcome: Outcome, model: str) -> Response:
        if outcome.kind == "error" or outcome.completion is None:
            return self._error(dialect, outcome.status, outcome.message)
        try:
            if canonical.stream:
                events = list(dialect.stream_events(outcome.completion, canonical, model=model))
                return StreamingResponse(
                    _iter_bytes(events), media_type=_media(canonical), headers=SSE_HEADERS
                )
            return json_response(dialect.from_chat_completion(outcome.completion, canonical, model=model))
        except DialectError as exc:
            return self._error(dialect, exc.status, str(exc))

    async def _stream(
        self, task: asyncio.Task[Outcome], dialect: Dialect, canonical: CanonicalRequest, model: str
    ) -> Response:
        """Answer a streaming call: wait a little for a fast engine (so errors keep their status),
        then commit to a 200 event stream that sends keep-alives until the engine is done."""
        try:
            outcome = await asyncio.wait_for(asyncio.shield(task), timeout=self.settings.keepalive_seconds)
        except TimeoutError:
            pass
        else:
            return self._reply(dialect, canonical, outcome, model)

        async def events() -> AsyncIterator[bytes]:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.settings.keepalive_seconds)
                if done:
                    break
                # Gemini without alt=sse streams one JSON array: whitespace is its only no-op.
                yield dialect.keepalive() if _media(canonical) == "text/event-stream" else b"\n"
            result = task.result()
            if result.kind == "error" or result.completion is None:
                body = orjson.dumps(dialect.error_body(result.status, result.message))
                prefix = b"event: error\n" if dialect.name == "anthropic_messages" else b""
                yield prefix + b"data: " + body + b"\n\n"
                return
            try:
                for event in dialect.stream_events(result.completion, canonical, model=model):
                    yield event
            except DialectError as exc:
                yield b"data: " + orjson.dumps(dialect.error_body(exc.status, str(exc))) + b"\n\n"

        return StreamingResponse(events(), media_type=_media(canonical), headers=SSE_HEADERS)


def _strip_reasoning(completion: JsonObject) -> None:
    """Leave reasoning out of the reply (the record, already written, keeps it)."""
    for choice in completion.get("choices") or []:
        message = choice.get("message") if isinstance(choice, dict) else None
        if isinstance(message, dict):
            choice["message"] = {
                k: v for k, v in message.items() if k not in ("reasoning_content", "reasoning")
            }


def _media(canonical: CanonicalRequest) -> str:
    return "text/event-stream" if canonical.state.get("sse", True) else "application/json"


async def _iter_bytes(events: list[bytes]) -> AsyncIterator[bytes]:
    # One write for the whole replay: fewer syscalls, and a client sees it at once anyway.
    yield b"".join(events)


def create_proxy_app(
    settings: ProxySettings,
    *,
    upstream: httpx.AsyncClient | None = None,
    store: CallStore,
    shard: tuple[int, int] | None = None,
    log_level: str = "warning",
) -> Starlette:
    """The proxy as a Starlette app. Pass ``upstream`` to swap the engine transport in tests.

    With ``settings.workers > 1`` this is the main process of a worker pool (shard 0 plus the
    control plane; it starts the other workers in its lifespan). ``shard`` is set only inside a
    pool's worker process.
    """
    settings.validate()
    pool = None
    if shard is None and settings.workers > 1:
        from fineenvs.proxy.workers import WorkerPool, share_of_engine

        pool = WorkerPool(settings, log_level=log_level)
        shard = (0, settings.workers)
        settings = dataclasses.replace(settings, max_upstream_concurrency=share_of_engine(settings))
    engine: EngineClient = (
        HttpxEngine(upstream)
        if upstream is not None
        else RawEngine(settings.upstream_url, max_connections=settings.max_upstream_concurrency)
    )
    proxy = ProxyApp(settings, engine, store, shard=shard or (0, 1))
    control = ControlPlane(proxy, pool)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if pool is not None:
            await pool.startup()
        try:
            yield
        finally:
            if pool is not None:
                await pool.shutdown()
            if proxy.tasks:
                await asyncio.gather(*proxy.tasks, return_exceptions=True)
            if upstream is None:
                await engine.aclose()
            await proxy.versions.aclose()
            await asyncio.to_thread(store.close)

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
    handlers: list[tuple[str, Callable[[Request], Awaitable[Response]], list[str]]] = [
        ("/health", control.health, ["GET", "HEAD"]),
        ("/sessions", control.create_session, ["POST"]),
        ("/sessions", control.list_sessions, ["GET"]),
        ("/sessions/{session_id}", control.session_stats, ["GET"]),
        ("/sessions/{session_id}", control.delete_session, ["DELETE"]),
        ("/sessions/{session_id}/rollout", control.rollout, ["GET"]),
        ("/{path:path}", proxy.model_route, methods),
    ]
    app = Starlette(
        routes=[Route(p, h, methods=m) for p, h, m in handlers],
        middleware=[Middleware(_ModelCallsFirst, proxy=proxy)],
        lifespan=lifespan,
    )
    app.state.proxy = proxy
    return app


class _ModelCallsFirst:
    """Model calls go straight to their handler; control routes take Starlette's router.

    The router's per-route regex matching and its exception and request/response wrappers cost
    about a tenth of a small call's CPU. Everything that is not ``/health`` or ``/sessions...``
    is a model call (the router's catch-all route says the same); errors still reach Starlette's
    outermost error middleware.
    """

    def __init__(self, app: ASGIApp, proxy: ProxyApp) -> None:
        self.app = app
        self.proxy = proxy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            if path != "/health" and path != "/sessions" and not path.startswith("/sessions/"):
                request = Request(scope, receive, send)
                try:
                    response = await self.proxy.model_route(request)
                except Exception as exc:  # never a plain-text 500 and a dropped connection
                    log.exception("model call on %s failed inside the proxy", path)
                    dialect = self.proxy._dialect(detect(path, request.headers, None))
                    response = self.proxy._error(
                        dialect,
                        500,
                        f"the capture proxy failed on this call ({type(exc).__name__}); retry it.",
                    )
                await response(scope, receive, send)
                return
        elif scope["type"] == "websocket":
            await serve_websocket(self.proxy, scope, receive, send)
            return
        await self.app(scope, receive, send)
