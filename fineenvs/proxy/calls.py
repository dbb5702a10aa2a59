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
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response

from fineenvs.dialects.base import CanonicalRequest, Dialect
from fineenvs.proxy.sessions import Session, SessionRegistry
from fineenvs.proxy.settings import ProxySettings
from fineenvs.proxy.store import RequestRecord

PREFIX_RE = re.compile(r"^/s/([^/]+)(/.*)?$")
BUDGET_TEXT = (
    "fineenvs proxy: this attempt has used all {n} model calls it is allowed. "
    "Stop here: no further actions will be run."
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
    fields: dict[str, Any]
    hide_reasoning: bool = False
    """The agent asked for no reasoning (``include_reasoning: false``): recorded, not replied."""


@dataclass
class Outcome:
    """What one forwarded model call produced: an engine completion, a stop reply, or an error."""

    kind: str  # "ok" | "stop" | "error"
    completion: dict[str, Any] | None = None
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

    async def record_event(
        self, session: Session, kind: str, index: int | None, fields: dict[str, Any]
    ) -> None: ...

    async def forward_call(self, call: PreparedCall, index: int) -> Outcome: ...
