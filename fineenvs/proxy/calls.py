"""One model call inside the proxy, as the HTTP route and the Responses WebSocket both see it.

``PreparedCall`` is a converted, authenticated call ready to forward; ``Outcome`` what forwarding
produced; ``CpuTurn`` bounds the CPU work done per event-loop iteration; ``CallHost`` is what a
transport needs of the proxy (``fineenvs.proxy.app.ProxyApp`` has it), so the WebSocket transport
(``fineenvs.proxy.websocket``) needs no import of the app that serves it.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Protocol

from starlette.requests import Request
from starlette.responses import Response

from fineenvs.dialects.base import CanonicalRequest, Dialect
from fineenvs.jsonl import JsonObject
from fineenvs.proxy.sessions import Session, SessionRegistry
from fineenvs.proxy.settings import ProxySettings
from fineenvs.proxy.store import RequestRecord

PREFIX_RE = re.compile(r"^/s/([^/]+)(/.*)?$")
BUDGET_TEXT = (
    "fineenvs proxy: this attempt has used all {n} model calls it is allowed. "
    "Stop here: no further actions will be run."
)


def split_session_prefix(path: str) -> tuple[str | None, str]:
    """``(session key, the rest)`` of a ``/s/<key>/...`` path; ``(None, path)`` without the prefix."""
    if m := PREFIX_RE.match(path):
        return m.group(1), m.group(2) or "/"
    return None, path


def no_session_message(key: str | None) -> str:
    """Why a call with session key ``key`` (None: none sent) has no session, and the fix."""
    what = "no session key was sent" if not key else "the session key is unknown or closed"
    return (
        f"{what}. Use the base_url or key returned by POST /sessions "
        "(path prefix /s/<key>, or the key as the API key)."
    )


@dataclass
class PreparedCall:
    """One converted model call, reduced to what forwarding, recording and replying need."""

    session: Session
    dialect_name: str
    dialect: Dialect
    reply_request: CanonicalRequest  # without messages/tools: dialects read only flags and state
    payload: bytes
    record_request: RequestRecord
    fields: JsonObject  # the call record's fields known before the engine answers
    hide_reasoning: bool = False
    """The agent asked for no reasoning (``include_reasoning: false``): recorded, not replied."""


@dataclass
class Outcome:
    """What one forwarded model call produced: an engine completion, a stop reply, or an error."""

    kind: str  # "ok" | "stop" | "error"
    completion: JsonObject | None = None
    status: int = 200
    message: str = ""


class CpuTurn:
    """``async with``: at most ``slots`` requests do CPU work per event-loop iteration.

    A burst of 1,000 arriving calls would otherwise all parse and convert in one iteration
    (about half a second), and /health would wait behind them. (A plain class: an
    ``asynccontextmanager`` costs a generator per use, three uses per call.)
    """

    def __init__(self, slots: int) -> None:
        self.slots = asyncio.Semaphore(slots)

    async def __aenter__(self) -> None:
        await self.slots.acquire()
        try:
            await asyncio.sleep(0)
        except BaseException:
            self.slots.release()
            raise

    async def __aexit__(self, *exc: object) -> None:
        self.slots.release()


class CallHost(Protocol):
    """What a transport (the WebSocket route) uses of the proxy to run model calls."""

    settings: ProxySettings
    sessions: SessionRegistry
    inflight: int
    aux_calls: int
    tasks: set[asyncio.Task[Outcome]]
    cpu_turn: CpuTurn

    def prepare_call(
        self, request: Request, path: str, path_key: str | None, raw: bytes | None
    ) -> Response | PreparedCall: ...

    async def start_call(self, prepared: PreparedCall) -> Outcome | asyncio.Task[Outcome]: ...
