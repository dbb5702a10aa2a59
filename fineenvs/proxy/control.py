"""The control plane: sessions (create, list, stats, rollout, close) and ``/health``.

Session routes are the trainer's and require the admin key when one is set (constant-time
comparison). ``/health`` is unauthenticated, allocation-light and never waits on model calls.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Sequence
from typing import Protocol

import httpx
import orjson
from starlette.requests import Request
from starlette.responses import Response

from fineenvs.jsonl import JsonObject
from fineenvs.proxy.sessions import Session, SessionRegistry, new_session_id, shard_of
from fineenvs.proxy.settings import ProxySettings
from fineenvs.proxy.store import CallStore
from fineenvs.proxy.wire import bearer, json_response
from fineenvs.trajectory.record import CallRecord, calls_to_nodes


class ControlledProxy(Protocol):
    """What the control plane reads of the proxy it fronts (``fineenvs.proxy.app.ProxyApp``)."""

    @property
    def settings(self) -> ProxySettings: ...
    @property
    def sessions(self) -> SessionRegistry: ...
    @property
    def store(self) -> CallStore: ...
    @property
    def shard(self) -> tuple[int, int]: ...
    @property
    def inflight(self) -> int: ...
    @property
    def started(self) -> float: ...


class WorkerAddress(Protocol):
    @property
    def shard(self) -> int: ...
    @property
    def port(self) -> int: ...


class WorkerDirectory(Protocol):
    """What the control plane needs of a worker pool (``fineenvs.proxy.workers.WorkerPool``)."""

    @property
    def workers(self) -> Sequence[WorkerAddress]: ...

    def worker(self, shard: int) -> WorkerAddress: ...

    def status(self) -> list[JsonObject]: ...

    async def forward(
        self, shard: int, method: str, path: str, *, query: bytes = b"", body: bytes | None = None
    ) -> httpx.Response: ...


class ControlPlane:
    """Control routes; with a worker pool, requests about another shard's session go to its owner."""

    def __init__(self, proxy: ControlledProxy, pool: WorkerDirectory | None = None) -> None:
        self.proxy = proxy
        self.pool = pool

    def _owner(self, session_id: str) -> int:
        return shard_of(session_id, self.proxy.shard[1])

    async def _forwarded(self, request: Request, shard: int, body: bytes | None = None) -> Response:
        assert self.pool is not None
        try:
            resp = await self.pool.forward(
                shard, request.method, request.url.path, query=request.url.query.encode(), body=body
            )
        except Exception as exc:  # noqa: BLE001 - a dead worker is the caller's 503, not a crash
            return json_response(
                {
                    "error": f"fineenvs proxy: worker {shard} did not answer ({type(exc).__name__}: {exc}); "
                    "it is restarted automatically, retry shortly."
                },
                503,
            )
        return Response(resp.content, status_code=resp.status_code, media_type="application/json")

    def _admin_denied(self, request: Request) -> Response | None:
        expected = self.proxy.settings.admin_key
        if not expected:
            return None
        presented = bearer(request.headers) or request.headers.get("x-admin-key") or ""
        if hmac.compare_digest(presented.encode(), expected.encode()):
            return None
        return json_response(
            {
                "error": "fineenvs proxy: control routes need the admin key "
                "(Authorization: Bearer <admin key> or x-admin-key)."
            },
            401,
        )

    async def health(self, request: Request) -> Response:
        body: JsonObject = {
            "status": "ok",
            "served_model": self.proxy.settings.served_model,
            "sessions": len(self.proxy.sessions.by_digest),
            "inflight": self.proxy.inflight,
            "uptime_s": round(time.time() - self.proxy.started, 3),
        }
        if self.proxy.shard[1] > 1:
            body["shard"] = self.proxy.shard[0]
        if self.pool is not None:
            # Process liveness only (no network): /health must stay cheap under load.
            body["workers"] = self.pool.status()
            if not all(w["alive"] for w in body["workers"]):
                body["status"] = "degraded"
        return json_response(body)

    async def create_session(self, request: Request) -> Response:
        if denied := self._admin_denied(request):
            return denied
        try:
            payload = orjson.loads(await request.body() or b"{}")
        except orjson.JSONDecodeError as exc:
            return json_response({"error": f"fineenvs proxy: POST /sessions body is not JSON: {exc}"}, 400)
        if not isinstance(payload, dict):
            return json_response({"error": "fineenvs proxy: POST /sessions body must be a JSON object."}, 400)
        metadata = payload.get("metadata") or {}
        if not isinstance(metadata, dict):
            return json_response({"error": "fineenvs proxy: metadata must be a JSON object."}, 400)
        metadata = dict(metadata)
        for key in ("task", "group", "harness", "attempt", "policy_version"):
            if key in payload:
                metadata[key] = payload[key]
        budget = payload.get("max_model_calls")
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool)):
            return json_response(
                {"error": f"fineenvs proxy: max_model_calls must be an integer, got {budget!r}."}, 400
            )
        seed = payload.get("sampling_seed")  # checked by the registry, which names the fix
        session_id = payload.get("session_id")
        if session_id is not None and not isinstance(session_id, str):
            return json_response({"error": "fineenvs proxy: session_id must be a string."}, 400)
        if self.pool is not None:
            session_id = session_id or new_session_id()
            shard = self._owner(session_id)
            if shard != self.proxy.shard[0]:
                forwarded = await self._forwarded(
                    request, shard, orjson.dumps({**payload, "session_id": session_id})
                )
                if forwarded.status_code == 201:
                    # The worker names itself by the address we reached it on; agents need the
                    # host they reached us on, with the worker's port.
                    reply = orjson.loads(forwarded.body)
                    origin = request.base_url
                    host = origin.hostname or "127.0.0.1"
                    host = f"[{host}]" if ":" in host else host
                    port = self.pool.worker(shard).port
                    reply["base_url"] = f"{origin.scheme}://{host}:{port}/s/{reply['key']}"
                    reply["shard"] = shard
                    return json_response(reply, 201)
                return forwarded
        try:
            session, key = await self.proxy.sessions.create(
                metadata, max_model_calls=budget, session_id=session_id, sampling_seed=seed
            )
        except ValueError as exc:
            return json_response({"error": f"fineenvs proxy: {exc}"}, 400)
        base = str(request.base_url).rstrip("/")
        return json_response(
            {
                "session_id": session.session_id,
                "key": key,
                "base_url": f"{base}/s/{key}",
                "max_model_calls": session.max_model_calls,
                "metadata": session.metadata,
                **({"sampling_seed": session.sampling_seed} if session.sampling_seed is not None else {}),
                **({"shard": self.proxy.shard[0]} if self.proxy.shard[1] > 1 else {}),
            },
            201,
        )

    async def list_sessions(self, request: Request) -> Response:
        if denied := self._admin_denied(request):
            return denied
        sessions = [s.stats() for s in list(self.proxy.sessions.by_id.values())]
        if self.pool is not None:
            replies = await asyncio.gather(*(self._forwarded(request, w.shard) for w in self.pool.workers))
            for reply in replies:
                if reply.status_code != 200:
                    return reply
                sessions += orjson.loads(reply.body)["sessions"]
        return json_response({"sessions": sessions})

    def _foreign(self, request: Request) -> int | None:
        """The shard owning the path's session when that is another process, else None."""
        if self.pool is None:
            return None
        shard = self._owner(request.path_params["session_id"])
        return None if shard == self.proxy.shard[0] else shard

    async def _session_route(self, request: Request) -> Session | Response:
        """The session a ``/sessions/{id}`` route names, or the route's answer when it is not here.

        That answer is the 401 for a missing admin key, the answer of the worker that owns the
        session, or a 404.
        """
        if denied := self._admin_denied(request):
            return denied
        if (shard := self._foreign(request)) is not None:
            return await self._forwarded(request, shard)
        sid = request.path_params["session_id"]
        session = self.proxy.sessions.get(sid)
        if session is None:
            return json_response(
                {"error": f"fineenvs proxy: no session {sid!r}; GET /sessions lists them."}, 404
            )
        return session

    async def session_stats(self, request: Request) -> Response:
        session = await self._session_route(request)
        return session if isinstance(session, Response) else json_response(session.stats())

    async def rollout(self, request: Request) -> Response:
        session = await self._session_route(request)
        if isinstance(session, Response):
            return session
        data = await asyncio.to_thread(self.proxy.store.read_session, session.session_id)
        body: JsonObject = {"session": session.stats(), "calls": data["calls"], "events": data["events"]}
        # ?trajectory=false: callers that build rows with their own options (the attempt runner)
        # skip building the graph here a second time.
        if request.query_params.get("trajectory", "true").lower() not in ("0", "false", "no"):
            metadata = {**session.metadata, "session_id": session.session_id}
            body.update(await asyncio.to_thread(build_trajectory, data["calls"], metadata))
        return json_response(body)

    async def delete_session(self, request: Request) -> Response:
        session = await self._session_route(request)
        if isinstance(session, Response):
            return session
        await self.proxy.sessions.close(session)
        purge = request.query_params.get("purge", "").lower() in ("1", "true", "yes")
        if purge:
            await asyncio.to_thread(self.proxy.store.delete_session_files, session.session_id)
            self.proxy.sessions.forget(session)
        return json_response({"session_id": session.session_id, "closed": True, "purged": purge})


def build_trajectory(calls: list[CallRecord], metadata: JsonObject) -> JsonObject:
    """The session's graph, rows, findings and metrics (``fineenvs.trajectory``) as JSON."""
    from fineenvs.trajectory import build_session, session_to_json

    return {"trajectory": session_to_json(build_session(calls_to_nodes(calls), metadata))}
