"""Byte pipes between a TCP port and a Unix socket, for the network-less bwrap sandbox.

Inside the sandbox (own network namespace: loopback only) the agent must still reach the proxy at
the same ``host:port`` it was configured with. Outside, :func:`serve_unix_to_tcp` accepts on a
Unix socket in a short private folder and connects to the real proxy; inside, this file runs as a
script (stdlib only, system python) that listens on ``127.0.0.1:PORT``, forwards each connection
to that Unix socket, runs the agent as its child and exits with the agent's status.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable

Opener = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        try:
            writer.close()
        except (ConnectionError, OSError):
            pass


def _handler(
    open_upstream: Opener,
) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await open_upstream()
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    return handle


class UnixToTcp:
    """Outside half: a Unix socket whose connections are piped to ``host:port`` (a thread)."""

    def __init__(self, socket_path: str, host: str, port: int, *, cleanup_dir: str | None = None) -> None:
        self.socket_path, self.host, self.port = socket_path, host, port
        self.cleanup_dir = cleanup_dir  # removed (when empty) after the socket
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fineenvs-netbridge", daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self._error: BaseException | None = None

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def opener() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            return await asyncio.open_connection(self.host, self.port)

        async def start() -> None:
            self._server = await asyncio.start_unix_server(_handler(opener), path=self.socket_path)

        try:
            self._loop.run_until_complete(start())
        except BaseException as e:  # reported by __enter__, in the caller's thread
            self._error = e
            return
        finally:
            self._ready.set()
        self._loop.run_forever()

    def __enter__(self) -> UnixToTcp:
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            if self.cleanup_dir is not None:  # __exit__ will not run
                os.rmdir(self.cleanup_dir)
            raise RuntimeError(
                f"the sandbox's proxy bridge could not listen on {self.socket_path}: {self._error}"
            ) from self._error
        return self

    def __exit__(self, *exc: object) -> None:
        def stop() -> None:
            if self._server is not None:
                self._server.close()
            self._loop.stop()

        if self._loop.is_running():
            self._loop.call_soon_threadsafe(stop)
        self._thread.join(5)
        try:
            os.unlink(self.socket_path)
        except OSError:
            pass
        if self.cleanup_dir is not None:
            try:
                os.rmdir(self.cleanup_dir)
            except OSError:
                pass


def main(argv: list[str]) -> int:
    """``netbridge.py PORT SOCKET -- AGENT ARGV...`` (run inside the sandbox)."""
    if len(argv) < 4 or argv[2] != "--":
        print("usage: netbridge.py PORT SOCKET -- AGENT ARGV...", file=sys.stderr)
        return 2
    port, sock, agent = int(argv[0]), argv[1], argv[3:]
    loop = asyncio.new_event_loop()

    async def opener() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_unix_connection(sock)

    server = loop.run_until_complete(asyncio.start_server(_handler(opener), "127.0.0.1", port))
    threading.Thread(target=loop.run_forever, daemon=True).start()
    proc = subprocess.Popen(agent)

    def forward(signum: int, _frame: object) -> None:
        proc.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    code = proc.wait()
    loop.call_soon_threadsafe(server.close)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
