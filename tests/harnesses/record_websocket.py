"""Record the Responses WebSocket frames of the real Codex CLI into tests/fixtures/websocket/codex.json.

Codex (default transport: its built-in ``openai`` provider) runs one attempt against the scripted
engine through the real proxy, with a relay in front of the proxy (``websockets`` server and
client) that forwards every frame both ways and keeps the upgrade request (path, headers) and
every frame as sent. The session key becomes ``SESSION_KEY`` and auth headers ``<scrubbed>``.
The proxy conformance test (tests/proxy/test_websocket.py) replays the client frames.

    python -m tests.harnesses.record_websocket
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve

from fineenvs.harnesses import HARNESSES, check_installed
from fineenvs.harnesses.sandbox import run_attempt
from tests.harnesses.record_requests import DROP_HEADERS, SECRET_HEADERS
from tests.harnesses.scripted_engine import ScriptedEngine
from tests.harnesses.stack import free_port, start_proxy

OUT = Path(__file__).resolve().parents[1] / "fixtures" / "websocket" / "codex.json"
HOP_HEADERS = DROP_HEADERS | {
    "upgrade",
    "sec-websocket-key",
    "sec-websocket-version",
    "sec-websocket-extensions",
}


class Relay:
    """ws://127.0.0.1:PORT -> the proxy, recording the upgrade and the frames of each connection."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.replace("http://", "ws://")
        self.connections: list[dict[str, Any]] = []
        self.port = free_port()
        self.ready = threading.Event()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self._run, daemon=True).start()
        self.ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        async with serve(self._handle, "127.0.0.1", self.port):
            self.ready.set()
            await asyncio.Future()

    async def _handle(self, client: ServerConnection) -> None:
        req = client.request
        assert req is not None
        headers = {k: v for k, v in req.headers.raw_items() if k.lower() not in HOP_HEADERS}
        record: dict[str, Any] = {"path": req.path, "headers": dict(req.headers.raw_items()), "frames": []}
        self.connections.append(record)
        async with connect(self.upstream + req.path, additional_headers=headers) as server:

            async def pump(src: Any, dst: Any, direction: str) -> None:
                async for message in src:
                    record["frames"].append({"from": direction, "data": json.loads(message)})
                    await dst.send(message)

            up = asyncio.create_task(pump(client, server, "client"))
            down = asyncio.create_task(pump(server, client, "server"))
            await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
            for task in (up, down):
                task.cancel()


def scrub(connection: dict[str, Any], key: str) -> dict[str, Any]:
    text = json.dumps(connection).replace(key, "SESSION_KEY")
    out: dict[str, Any] = json.loads(text)
    out["headers"] = {
        k.lower(): ("<scrubbed>" if k.lower() in SECRET_HEADERS else v)
        for k, v in sorted(out["headers"].items())
        if k.lower() not in DROP_HEADERS | {"sec-websocket-key"}
    }
    return out


def main() -> int:
    if problems := check_installed(["codex"]):
        print(problems[0])
        return 1
    h = HARNESSES["codex"]
    engine = ScriptedEngine().start()
    work = Path(tempfile.mkdtemp(prefix="fineenvs-record-ws-"))
    proxy = start_proxy(engine.url, "tiny_qwen", work / "store")
    relay = Relay(proxy.url)
    try:
        session = proxy.new_session(harness="codex")
        base = f"http://127.0.0.1:{relay.port}" + urlsplit(session["base_url"]).path
        result = run_attempt(
            h,
            task_prompt="Compute 6*7 and write the number to answer.txt using the shell.",
            input_files={},
            attempt_dir=work / "codex",
            base_url=base,
            session_key=session["key"],
            model="tiny_qwen",
            timeout_seconds=240,
            step_limit=8,
        )
        if not relay.connections:
            print(f"codex made no WebSocket connection ({result.exit_reason})")
            return 1
        doc = {
            "harness": "codex",
            "package": h.package,
            "version": h.version,
            "api_format": "openai_responses",
            "transport": "websocket",
            "exit_reason": result.exit_reason,
            "connections": [scrub(c, session["key"]) for c in relay.connections],
        }
        OUT.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
        frames = [f for c in relay.connections for f in c["frames"]]
        print(
            f"codex: {result.exit_reason}, {len(relay.connections)} connection(s), {len(frames)} frames -> {OUT}"
        )
    finally:
        proxy.stop()
        engine.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
