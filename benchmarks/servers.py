"""The benchmarks' helper processes: an instant engine stand-in, a TCP relay, a /health poller.

Each runs in its own process, so the load generator's busy event loop never slows what it serves
or inflates what it measures::

    python -m benchmarks.servers standin --port P [--delay-ms D] [--replica-name R]
    python -m benchmarks.servers relay --port P --upstream U
    python -m benchmarks.servers poll-health --port P      # until stdin closes

The stand-in answers every chat completion with a canned, vLLM-shaped reply whose
``prompt_token_ids`` derive from the request bytes, so prompts grow and share prefixes like a real
agent's. It is a measuring instrument of the proxy's own cost, not an engine: the vLLM path runs
against the real vLLM. With ``--replica-name`` it also plays one replica behind vLLM's router: it
names itself in ``x-fineenvs-replica`` as vLLM's plugin middleware does, and answers the dev-mode
weight routes a push calls (loading nothing) while keeping the version it was told.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from typing import Any

import orjson

from benchmarks.common import HOST, SAMPLED, VOCAB


def _standin_reply(body: bytes) -> bytes:
    import numpy as np

    # Render like a chat template (tools first, then messages in order) so that a longer
    # conversation's prompt extends the shorter one's, then read 4 bytes as one token.
    request = orjson.loads(body) if body else {}
    rendered = orjson.dumps(request.get("tools")) + b"".join(
        orjson.dumps(m) for m in request.get("messages", [])
    )
    usable = len(rendered) // 4 * 4
    ids = np.frombuffer(rendered[:usable], dtype="<u4") % VOCAB
    head = {
        "id": "chatcmpl-standin",
        "object": "chat.completion",
        "created": 0,
        "model": "standin",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Done: the files are listed."},
                "finish_reason": "stop",
                "token_ids": SAMPLED,
                "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": -0.25} for t in SAMPLED]},
            }
        ],
        "usage": {"prompt_tokens": int(ids.size), "completion_tokens": len(SAMPLED), "total_tokens": 0},
        "weight_version": 0,
    }
    return (
        orjson.dumps(head)[:-1]
        + b',"prompt_token_ids":'
        + orjson.dumps(ids, option=orjson.OPT_SERIALIZE_NUMPY)
        + b"}"
    )


class _Replica:
    """What a replica stand-in remembers between calls: its name and the version it was given."""

    def __init__(self, name: str | None) -> None:
        self.extra = f"x-fineenvs-replica: {name}\r\n".encode() if name else b""
        self.version: str | None = None

    def control(self, path: bytes, body: bytes) -> bytes:
        """The dev-mode weight routes: instant, so a push's time is the control plane's alone."""
        route = path.split(b"?", 1)[0]
        if route == b"/update_weight_version":
            self.version = str(orjson.loads(body)["new_version"])
        if route == b"/weight_info":
            return orjson.dumps({"weight_version": self.version})
        if route == b"/reset_prefix_cache":
            return b'{"success":true}'
        return b'{"status":"ok"}'


async def _standin_conn(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    delay_s: float = 0.0,
    replica: _Replica | None = None,
) -> None:
    extra = replica.extra if replica is not None else b""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            body = await reader.readexactly(length) if length else b""
            path = head.split(b" ", 2)[1]
            chat = path.startswith(b"/v1/chat/completions")
            if chat and delay_s:
                await asyncio.sleep(delay_s)  # an engine at work: time passes, no CPU is spent
            if chat:
                reply = _standin_reply(body)
            elif replica is not None:
                reply = replica.control(path, body)
            else:
                reply = b'{"status":"ok"}'
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n"
                % (len(reply), extra)
                + reply
            )
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
        pass
    finally:
        writer.close()


async def _relay_pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 20):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


def run_relay(port: int, upstream: int) -> None:
    """A null proxy: copies bytes between each client connection and its own upstream connection.

    It parses nothing, converts nothing and records nothing, so its throughput against the stand-in
    is the most any process placed in the path can reach on this machine.
    """

    async def conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(HOST, upstream, limit=1 << 22)
        await asyncio.gather(_relay_pipe(reader, up_writer), _relay_pipe(up_reader, writer))

    async def serve() -> None:
        server = await asyncio.start_server(conn, HOST, port, backlog=4096, limit=1 << 22)
        async with server:
            await server.serve_forever()

    _run_fast(serve())


def _run_fast(coro: Any) -> None:
    # The proxy runs on uvloop (uvicorn's default when installed): give the baselines the same loop.
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:
        asyncio.run(coro)


def run_standin(port: int, delay_ms: float = 0.0, replica_name: str | None = None) -> None:
    replica = _Replica(replica_name) if replica_name else None

    async def conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _standin_conn(reader, writer, delay_ms / 1000, replica)

    async def serve() -> None:
        server = await asyncio.start_server(conn, HOST, port, backlog=4096, limit=1 << 20)
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


# ---------------------------------------------------------------------------------------------
# Raw HTTP/1.1 keep-alive client


def poll_health(port: int, interval: float = 0.02) -> None:
    """Subprocess body: GET /health every ``interval`` s until stdin closes; print latencies (ms).

    It runs in its own process so that the load generator's busy event loop cannot inflate the
    latency it measures.
    """
    import threading

    stop = threading.Event()

    def wait_for_eof() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    sock = socket.create_connection((HOST, port))
    request = f"GET /health HTTP/1.1\r\nhost: {HOST}:{port}\r\n\r\n".encode()
    times: list[float] = []
    while not stop.is_set():
        t0 = time.perf_counter()
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        while len(body) < length:
            body += sock.recv(65536)
        times.append((time.perf_counter() - t0) * 1000 if head.startswith(b"HTTP/1.1 200") else float("inf"))
        stop.wait(interval)
    print(orjson.dumps(times).decode(), flush=True)


class HealthPoller:
    def __init__(self, port: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.servers", "poll-health", "--port", str(port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )

    def finish(self) -> list[float]:
        out, _ = self.proc.communicate(b"", timeout=60)
        return [float(x) for x in orjson.loads(out)]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["standin"]:
        delay = float(argv[argv.index("--delay-ms") + 1]) if "--delay-ms" in argv else 0.0
        name = argv[argv.index("--replica-name") + 1] if "--replica-name" in argv else None
        run_standin(int(argv[argv.index("--port") + 1]), delay, name)
        return 0
    if argv[:1] == ["relay"]:
        run_relay(int(argv[argv.index("--port") + 1]), int(argv[argv.index("--upstream") + 1]))
        return 0
    if argv[:1] == ["poll-health"]:
        poll_health(int(argv[argv.index("--port") + 1]))
        return 0
    print(
        "usage: python -m benchmarks.servers {standin --port P [--delay-ms D] [--replica-name R] | relay --port P "
        "--upstream U | poll-health --port P}",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
