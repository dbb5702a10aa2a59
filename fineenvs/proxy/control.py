"""The control plane: sessions (create, list, stats, rollout, close) and ``/health``.

Session routes are the trainer's and require the admin key when one is set (constant-time
comparison). ``/health`` is unauthenticated, allocation-light and never waits on model calls.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from fineenvs.proxy.sessions import Session
from fineenvs.proxy.wire import bearer, json_response

if TYPE_CHECKING:
    from fineenvs.proxy.app import ProxyApp


class ControlPlane:
    def __init__(self, proxy: ProxyApp) -> None:
        self.proxy = proxy

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
        return json_response(
            {
                "status": "ok",
                "served_model": self.proxy.settings.served_model,
                "sessions": len(self.proxy.sessions.by_digest),
                "inflight": self.proxy.inflight,
                "uptime_s": round(time.time() - self.proxy.started, 3),
            }
        )

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
        session_id = payload.get("session_id")
        if session_id is not None and not isinstance(session_id, str):
            return json_response({"error": "fineenvs proxy: session_id must be a string."}, 400)
        try:
            session, key = await self.proxy.sessions.create(
                metadata, max_model_calls=budget, session_id=session_id
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
            },
            201,
        )

    async def list_sessions(self, request: Request) -> Response:
        if denied := self._admin_denied(request):
            return denied
        return json_response({"sessions": [s.stats() for s in list(self.proxy.sessions.by_id.values())]})

    def _session_or_404(self, request: Request) -> Session | Response:
        sid = request.path_params["session_id"]
        session = self.proxy.sessions.get(sid)
        if session is None:
            return json_response(
                {"error": f"fineenvs proxy: no session {sid!r}; GET /sessions lists them."}, 404
            )
        return session

    async def session_stats(self, request: Request) -> Response:
        if denied := self._admin_denied(request):
            return denied
        session = self._session_or_404(request)
        return session if isinstance(session, Response) else json_response(session.stats())

    async def rollout(self, request: Request) -> Response:
        if denied := self._admin_denied(request):
            return denied
        session = self._session_or_404(request)
        if isinstance(session, Response):
            return session
        data = await asyncio.to_thread(self.proxy.store.read_session, session.session_id)
        body: dict[str, Any] = {"session": session.stats(), "calls": data["calls"], "events": data["events"]}
        # ?trajectory=false: callers that build rows with their own options (the attempt runner)
        # skip building the graph here a second time.
        if request.query_params.get("trajectory", "true").lower() not in ("0", "false", "no"):
            metadata = {**session.metadata, "session_id": session.session_id}
            body.update(await asyncio.to_thread(build_trajectory, data["calls"], metadata))
        return json_response(body)

    async def delete_session(self, request: Request) -> Response:
        if denied := self._admin_denied(request):
            return denied
        session = self._session_or_404(request)
        if isinstance(session, Response):
            return session
        await self.proxy.sessions.close(session)
        purge = request.query_params.get("purge", "").lower() in ("1", "true", "yes")
        if purge:
            await asyncio.to_thread(self.proxy.store.delete_session_files, session.session_id)
            self.proxy.sessions.forget(session)
        return json_response({"session_id": session.session_id, "closed": True, "purged": purge})


def calls_to_nodes(calls: list[dict[str, Any]]) -> list[Any]:
    """Recorded calls (``CallStore.read_session(...)["calls"]``) as trajectory nodes.

    A call whose logprobs were missing or misaligned, or that has no prompt ids, is context only.
    """
    from fineenvs.trajectory import CallNode

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
        )
        for i, c in enumerate(calls)
    ]


def build_trajectory(calls: list[dict[str, Any]], metadata: dict[str, Any]) -> dict[str, Any]:
    """The session's graph, rows, findings and metrics (``fineenvs.trajectory``) as JSON."""
    from fineenvs.trajectory import build_session, session_to_json

    return {"trajectory": session_to_json(build_session(calls_to_nodes(calls), metadata))}
