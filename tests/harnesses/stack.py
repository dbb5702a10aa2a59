"""The real stack for harness end-to-end tests: an engine (scripted or embedded) and the capture proxy.

The proxy runs as its own process (``python -m fineenvs.proxy serve`` when that entry point exists,
else the app factory under uvicorn), exactly as an agent would meet it in production.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
ADMIN_KEY = "test-admin-key"

_LAUNCH_APP = """
import sys, uvicorn
from pathlib import Path
from fineenvs.proxy.app import create_proxy_app
from fineenvs.proxy.settings import ProxySettings
from fineenvs.proxy.store import CallStore
engine, model, port, store_dir, admin = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]), sys.argv[5]
settings = ProxySettings(upstream_url=engine, served_model=model, port=port, store_dir=store_dir, admin_key=admin, fsync=False)
app = create_proxy_app(settings, store=CallStore(store_dir))
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_json(
    method: str, url: str, body: Any = None, *, headers: dict[str, str] | None = None, timeout: float = 30
) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        url, data=data, method=method, headers={"content-type": "application/json", **(headers or {})}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"null")


def wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} before {url} answered")
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except (urllib.error.URLError, OSError):
            time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


@dataclass
class Proxy:
    url: str
    proc: subprocess.Popen[bytes]
    store_dir: Path
    log: Path

    def new_session(self, **payload: Any) -> dict[str, Any]:
        out: dict[str, Any] = http_json("POST", f"{self.url}/sessions", payload, headers=self._auth())
        return out

    def rollout(self, session_id: str) -> dict[str, Any]:
        """The session's stats and calls: the rollout route, else the stats route plus the store."""
        try:
            out: dict[str, Any] = http_json(
                "GET", f"{self.url}/sessions/{session_id}/rollout", headers=self._auth()
            )
            return out
        except urllib.error.HTTPError:
            from fineenvs.proxy.store import CallStore

            stats = http_json("GET", f"{self.url}/sessions/{session_id}", headers=self._auth())
            data = CallStore(self.store_dir, fsync=False).read_session(session_id)
            return {"session": stats, "calls": data["calls"], "events": data["events"], "via": "store"}

    def _auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {ADMIN_KEY}"}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_proxy(
    engine_url: str, served_model: str, store_dir: Path, extra_args: tuple[str, ...] = ()
) -> Proxy:
    port = free_port()
    store_dir.mkdir(parents=True, exist_ok=True)
    log = store_dir.parent / f"proxy-{port}.log"
    if (REPO / "fineenvs" / "proxy" / "__main__.py").exists():
        cmd = [
            sys.executable, "-m", "fineenvs.proxy", "serve",
            "--engine-url", engine_url, "--served-model", served_model,
            "--port", str(port), "--store-dir", str(store_dir), "--admin-key", ADMIN_KEY,
            "--no-fsync", "--log-level", "warning", *extra_args,
        ]  # fmt: skip
    else:
        cmd = [
            sys.executable,
            "-c",
            _LAUNCH_APP,
            engine_url,
            served_model,
            str(port),
            str(store_dir),
            ADMIN_KEY,
        ]
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", 60, proc)
    except Exception:
        proc.kill()
        raise RuntimeError(f"proxy did not start: {log.read_text(errors='replace')[-3000:]}") from None
    return Proxy(url=url, proc=proc, store_dir=store_dir, log=log)


@dataclass
class EmbeddedEngine:
    url: str
    proc: subprocess.Popen[bytes]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_embedded_engine(model: str, log: Path) -> EmbeddedEngine:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "fineenvs.engine",
        "serve",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", 180, proc)
    except Exception:
        proc.kill()
        raise RuntimeError(
            f"embedded engine did not start: {log.read_text(errors='replace')[-3000:]}"
        ) from None
    return EmbeddedEngine(url=url, proc=proc)
