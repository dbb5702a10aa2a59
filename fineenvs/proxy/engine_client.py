"""How the proxy POSTs to the engine: a lean keep-alive HTTP/1.1 client, or any httpx client.

Why not httpx in production: httpcore's pool re-checks every pooled connection (a ``poll()``
syscall each) and re-queues requests on each event; with hundreds of calls in flight that cost
several milliseconds of CPU per call and starved the event loop (measured with 1,000 concurrent
sessions: 2.7-17 ms of CPU per small call, ``/health`` p99 of seconds). The engine is one known
host speaking plain JSON over HTTP/1.1, so a pool of idle connections in a list is enough.

Tests inject an ``httpx.AsyncClient`` (``httpx.MockTransport``) through ``HttpxEngine``.

What is covered: ``http://`` and ``https://`` engines, Content-Length and chunked replies,
``Connection: close``, a bounded pool, one retry on a stale pooled connection that the engine
closed while idle (the request never reached it). What is not covered: HTTP/2, proxies, redirects.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import urlsplit

import httpx


class EngineUnreachable(Exception):
    """The engine could not be reached or dropped the connection (retryable)."""


@dataclass
class EngineResponse:
    status_code: int
    content: bytes
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


class EngineClient(Protocol):
    async def post_json(
        self, url: str, payload: bytes, *, timeout: float, headers: Mapping[str, str] | None = None
    ) -> EngineResponse: ...

    async def get(self, url: str, *, timeout: float) -> EngineResponse: ...

    async def aclose(self) -> None: ...


class HttpxEngine:
    """Adapter for an injected ``httpx.AsyncClient`` (tests, custom transports)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def post_json(
        self, url: str, payload: bytes, *, timeout: float, headers: Mapping[str, str] | None = None
    ) -> EngineResponse:
        try:
            resp = await self.client.post(
                url,
                content=payload,
                headers={"content-type": "application/json", **(headers or {})},
                timeout=timeout,
            )
        except httpx.TransportError as exc:
            raise EngineUnreachable(f"{type(exc).__name__}: {exc}") from exc
        return EngineResponse(resp.status_code, resp.content, dict(resp.headers))

    async def get(self, url: str, *, timeout: float) -> EngineResponse:
        try:
            resp = await self.client.get(url, timeout=timeout)
        except httpx.TransportError as exc:
            raise EngineUnreachable(f"{type(exc).__name__}: {exc}") from exc
        return EngineResponse(resp.status_code, resp.content, dict(resp.headers))

    async def aclose(self) -> None:
        await self.client.aclose()


def _header_line(name: str, value: str) -> bytes:
    """One request header line; a value with a line break would smuggle another header in."""
    if any(c in name + value for c in "\r\n") or not name:
        raise ValueError(f"header {name!r} has a line break or no name")
    return name.encode("latin-1") + b": " + value.encode("latin-1") + b"\r\n"


class _NothingBack(Exception):
    """The connection died before any reply byte: safe to resend on a fresh connection."""


_Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class RawEngine:
    """Keep-alive HTTP/1.1 POSTs to one engine host."""

    def __init__(self, base_url: str, *, max_connections: int = 256, connect_timeout: float = 10.0) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"engine URL {base_url!r} must look like http://host:port")
        self.host = parts.hostname
        self.tls = parts.scheme == "https"
        self.port = parts.port or (443 if self.tls else 80)
        self.host_header = parts.netloc.encode()
        self.connect_timeout = connect_timeout
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: list[_Conn] = []
        self._ssl: ssl.SSLContext | None = ssl.create_default_context() if self.tls else None

    async def _open(self) -> _Conn:
        try:
            return await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port, ssl=self._ssl, limit=1 << 24),
                self.connect_timeout,
            )
        except (OSError, TimeoutError) as exc:
            raise EngineUnreachable(
                f"cannot connect to {self.host}:{self.port} ({type(exc).__name__}: {exc})"
            ) from exc

    async def post_json(
        self, url: str, payload: bytes, *, timeout: float, headers: Mapping[str, str] | None = None
    ) -> EngineResponse:
        path = urlsplit(url).path or "/"
        extra = b"".join(_header_line(k, v) for k, v in (headers or {}).items())
        head = (
            b"POST " + path.encode() + b" HTTP/1.1\r\nhost: " + self.host_header + b"\r\n"
            b"content-type: application/json\r\naccept: application/json\r\n"
            + extra
            + b"content-length: "
            + str(len(payload)).encode()
            + b"\r\n\r\n"
        )
        return await self._request(head, payload, timeout)

    async def get(self, url: str, *, timeout: float) -> EngineResponse:
        path = urlsplit(url).path or "/"
        head = (
            b"GET "
            + path.encode()
            + b" HTTP/1.1\r\nhost: "
            + self.host_header
            + b"\r\naccept: application/json\r\n\r\n"
        )
        return await self._request(head, b"", timeout)

    async def _request(self, head: bytes, payload: bytes, timeout: float) -> EngineResponse:
        async with self._slots:
            for _ in range(2):
                reused = bool(self._idle)
                conn = self._idle.pop() if reused else await self._open()
                try:
                    resp, keep = await asyncio.wait_for(self._exchange(conn, head, payload), timeout)
                except _NothingBack as exc:
                    conn[1].close()
                    if reused:
                        continue  # a keep-alive socket the engine closed while idle: retry once, fresh
                    raise EngineUnreachable(f"{self.host}:{self.port} closed the connection ({exc})") from exc
                except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
                    conn[1].close()
                    raise EngineUnreachable(
                        f"connection to {self.host}:{self.port} failed mid-reply ({type(exc).__name__}: {exc})"
                    ) from exc
                except TimeoutError as exc:
                    conn[1].close()
                    raise EngineUnreachable(f"engine did not answer within {timeout} s") from exc
                except BaseException:
                    conn[1].close()  # cancelled mid-exchange: the connection state is unknown
                    raise
                if keep:
                    self._idle.append(conn)
                else:
                    conn[1].close()
                return resp
        raise EngineUnreachable(f"connection to {self.host}:{self.port} kept failing")

    @staticmethod
    async def _exchange(conn: _Conn, head: bytes, payload: bytes) -> tuple[EngineResponse, bool]:
        reader, writer = conn
        try:
            writer.write(head + payload)
            await writer.drain()
            raw = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise
            raise _NothingBack("no reply bytes") from exc
        except (ConnectionResetError, BrokenPipeError) as exc:
            raise _NothingBack(type(exc).__name__) from exc
        lines = raw[:-4].split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
        if "chunked" in headers.get("transfer-encoding", "").lower():
            chunks = []
            while True:
                size = int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
                if size == 0:
                    while (await reader.readuntil(b"\r\n")) != b"\r\n":
                        pass  # trailers
                    break
                chunks.append(await reader.readexactly(size))
                await reader.readexactly(2)
            body = b"".join(chunks)
        elif "content-length" in headers:
            body = await reader.readexactly(int(headers["content-length"]))
        else:
            body = await reader.read()  # delimited by close
            return EngineResponse(status, body, headers), False
        keep = headers.get("connection", "").lower() != "close"
        return EngineResponse(status, body, headers), keep

    async def aclose(self) -> None:
        while self._idle:
            self._idle.pop()[1].close()
