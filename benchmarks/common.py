"""What every benchmark shares: a minimal raw HTTP/1.1 client, request shapes, ports, /proc
readings (CPU, RSS, children) and percentiles. The load generator is raw so it costs little CPU
next to what it measures.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from pathlib import Path
from typing import Any

import orjson

HOST = "127.0.0.1"
SAMPLED = list(range(1000, 1020))
VOCAB = 151_000


class RawConn:
    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(
        self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(HOST, self.port, limit=1 << 22)
        assert self.reader is not None
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.writer.write(
            f"{method} {path} HTTP/1.1\r\nhost: {HOST}:{self.port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n{extra}\r\n".encode()
            + body
        )
        await self.writer.drain()
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length, chunked = None, False
        for line in head.split(b"\r\n")[1:]:
            low = line.lower()
            if low.startswith(b"content-length:"):
                length = int(line[15:])
            elif low.startswith(b"transfer-encoding:") and b"chunked" in low:
                chunked = True
        if chunked:
            parts = []
            while True:
                size = int((await self.reader.readuntil(b"\r\n"))[:-2], 16)
                parts.append(await self.reader.readexactly(size + 2))
                if size == 0:
                    break
            return status, b"".join(p[:-2] for p in parts)
        return status, await self.reader.readexactly(length or 0)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


# ---------------------------------------------------------------------------------------------
# Workloads


def small_chat(i: int) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": f"List the files, please ({i})."}]}


def claude_code_request(turns: int, *, target_bytes: int = 200_000) -> dict[str, Any]:
    """An Anthropic Messages body shaped like Claude Code's: big system blocks, ~20 tools, tool history."""
    words = "the quick brown fox jumps over the lazy dog while the agent reads files and edits code "
    system = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=00000;"},
        {
            "type": "text",
            "text": "You are Claude Code. " + words * 300,
            "cache_control": {"type": "ephemeral"},
        },
    ]
    tools = [
        {
            "name": f"tool_{t}",
            "description": (f"Tool number {t}. " + words * 12),
            "input_schema": {
                "type": "object",
                "properties": {f"arg{a}": {"type": "string", "description": words[:60]} for a in range(8)},
                "required": ["arg0"],
            },
        }
        for t in range(20)
    ]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Fix the failing test in the repo. " + words * 20}
    ]
    body = {
        "model": "claude-opus-4-8",
        "max_tokens": 32000,
        "system": system,
        "tools": tools,
        "messages": messages,
    }
    filler = 0
    while len(orjson.dumps(body)) < target_bytes:
        messages += _turn(filler, words * 40)
        filler += 1
    for t in range(turns):
        messages += _turn(10_000 + t, words * 10)
    return body


def _turn(n: int, output: str) -> list[dict[str, Any]]:
    return [
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": f"toolu_{n}", "name": "tool_1", "input": {"arg0": f"ls {n}"}}
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": f"toolu_{n}", "content": f"{n}: {output}"}],
        },
    ]


def as_engine_body(anthropic_body: dict[str, Any]) -> dict[str, Any]:
    """What the proxy would send upstream for ``anthropic_body`` (the direct baseline's request)."""
    from fineenvs.dialects import DIALECTS

    canonical = DIALECTS["anthropic_messages"].to_canonical(anthropic_body, path="/v1/messages", query={})
    return {**canonical.body, "model": "standin", "stream": False, "logprobs": True, "top_logprobs": 0}


# ---------------------------------------------------------------------------------------------
# Processes and measurement helpers


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (system time includes the kernel's fsync work)."""
    user, system = cpu_split(pid)
    return user + system


def cpu_split(pid: int) -> tuple[float, float]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def cpu_ms_exact(pid: int) -> float | None:
    """On-CPU milliseconds of every thread of ``pid`` at microsecond resolution (user + kernel).

    ``/proc/<pid>/stat`` counts 10 ms ticks, too coarse for a few dozen calls of a few ms each;
    the scheduler's own runtime (``se.sum_exec_runtime``) is exact. None where the kernel hides it.
    """
    total = 0.0
    try:
        for sched in Path(f"/proc/{pid}/task").glob("*/sched"):
            for line in sched.read_text().splitlines():
                if line.startswith("se.sum_exec_runtime"):
                    total += float(line.split(":")[1])
                    break
            else:
                return None
    except (OSError, ValueError):
        return None
    return total


def child_pids(parent: int) -> list[int]:
    """Processes whose parent is ``parent`` (from /proc)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == parent:
                pids.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return pids


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def wait_http(port: int, path: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        conn = RawConn(port)
        try:
            status, _ = await conn.request("GET", path)
            if status == 200:
                return
        except OSError:
            pass
        finally:
            conn.close()
        if time.monotonic() > deadline:
            raise RuntimeError(f"nothing answered on 127.0.0.1:{port}{path} within {timeout} s")
        await asyncio.sleep(0.1)


def free_ports(n: int) -> int:
    """A port P with P..P+n-1 all free (``serve --workers n`` binds that range)."""
    for _ in range(200):
        port = free_port()
        if port + n - 1 > 65535:
            continue
        with contextlib.ExitStack() as held:
            try:
                for k in range(1, n):
                    sock = held.enter_context(socket.socket())
                    sock.bind((HOST, port + k))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no {n} consecutive free ports on {HOST}")
