"""Record one real model request per harness into tests/fixtures/harness_records/<harness>.json.

Runs each installed harness (default format, or ``--all-formats``) against the scripted engine
through the real proxy, with a recording tap in front of the proxy that keeps the agent's own
request (method, path, headers, body) exactly as sent. Keys are scrubbed: the session key becomes
``SESSION_KEY`` wherever it appears, auth headers become ``<scrubbed>``. The dialect golden tests
replay these bodies.

    python -m tests.harnesses.record_requests [NAME ...] [--all-formats] [--structured]

``--structured`` also keeps every structured-output call (``output_config.format``,
``responseMimeType: application/json``, ``response_format``, ``text.format``) the agent made, with
the status the proxy answered, in ``<harness>.structured.json``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fineenvs.harnesses import HARNESSES, check_installed
from fineenvs.harnesses.sandbox import run_attempt
from tests.harnesses.scripted_engine import ScriptedEngine
from tests.harnesses.stack import start_proxy

OUT_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "harness_records"
SECRET_HEADERS = {"authorization", "x-api-key", "x-goog-api-key", "api-key", "cookie"}
DROP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "accept-encoding"}


class Tap:
    """A pass-through HTTP server that records every request before forwarding it."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.records: list[dict[str, Any]] = []
        tap = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                headers = {k: v for k, v in self.headers.items() if k.lower() not in DROP_HEADERS}
                conn = http.client.HTTPConnection(tap.host, tap.port, timeout=600)
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                tap.records.append(
                    {
                        "method": self.command,
                        "path": self.path,
                        "headers": dict(self.headers.items()),
                        "body": body.decode("utf-8", "replace"),
                        "status": resp.status,
                        "response_content_type": resp.getheader("content-type"),
                    }
                )
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in DROP_HEADERS:
                        self.send_header(k, v)
                self.send_header("content-length", str(len(data)))
                self.send_header("connection", "close")
                self.end_headers()
                self.wfile.write(data)
                conn.close()

            do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = do_OPTIONS = _forward  # noqa: N815

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()


def scrub(record: dict[str, Any], key: str) -> dict[str, Any]:
    headers = {
        k.lower(): ("<scrubbed>" if k.lower() in SECRET_HEADERS else v.replace(key, "SESSION_KEY"))
        for k, v in record["headers"].items()
        if k.lower() not in DROP_HEADERS
    }
    text = record["body"].replace(key, "SESSION_KEY")
    try:
        body: Any = json.loads(text)
    except ValueError:
        body = text
    return {
        "method": record["method"],
        "path": record["path"].replace(key, "SESSION_KEY"),
        "headers": dict(sorted(headers.items())),
        "body": body,
        "status": record["status"],
        "response_content_type": record["response_content_type"],
    }


def pick(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first model call that offers tools (the agent's real turn), else the first POST."""
    posts = [r for r in records if r["method"] == "POST" and r["body"].startswith("{")]
    for r in posts:
        body = json.loads(r["body"])
        if body.get("tools"):
            return r
    return posts[0] if posts else None


def is_structured(body: Any) -> bool:
    """Whether a request body asks for structured output, in any of the four formats."""
    if not isinstance(body, dict):
        return False
    output_config = body.get("output_config")
    if isinstance(output_config, dict) and output_config.get("format"):
        return True
    gen = body.get("generationConfig") or body.get("generation_config")
    if (
        isinstance(gen, dict)
        and (gen.get("responseMimeType") or gen.get("response_mime_type")) == "application/json"
    ):
        return True
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        return True
    text = body.get("text")
    return (
        isinstance(text, dict)
        and isinstance(text.get("format"), dict)
        and text["format"].get("type") != "text"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("names", nargs="*")
    parser.add_argument("--all-formats", action="store_true")
    parser.add_argument("--structured", action="store_true", help="also record structured-output calls")
    args = parser.parse_args()
    names = args.names or list(HARNESSES)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    engine = ScriptedEngine().start()
    work = Path(tempfile.mkdtemp(prefix="fineenvs-record-"))
    proxy = start_proxy(engine.url, "tiny_qwen", work / "store")
    tap = Tap(proxy.url)
    failed = 0
    try:
        for name in names:
            if problems := check_installed([name]):
                print(f"skip {name}: {problems[0]}")
                failed += 1
                continue
            h = HARNESSES[name]
            for fmt in h.api_formats if args.all_formats else (h.default_format,):
                session = proxy.new_session(harness=name)
                key = session["key"]
                before = len(tap.records)
                base = tap.url + urlsplit(session["base_url"]).path
                result = run_attempt(
                    h,
                    task_prompt="Compute 6*7 and write the number to answer.txt using the shell.",
                    input_files={},
                    attempt_dir=work / f"{name}-{fmt}",
                    base_url=base,
                    session_key=key,
                    model="tiny_qwen",
                    api_format=fmt,
                    timeout_seconds=240,
                    step_limit=8,
                )
                if args.structured:
                    structured = [
                        scrub(r, key)
                        for r in tap.records[before:]
                        if r["method"] == "POST"
                        and r["body"].startswith("{")
                        and is_structured(json.loads(r["body"]))
                    ]
                    if structured:
                        out_s = {"harness": name, "package": h.package, "version": h.version, "api_format": fmt,
                                 "requests": structured}  # fmt: skip
                        spath = (
                            OUT_DIR / f"{name}{'' if fmt == h.default_format else '.' + fmt}.structured.json"
                        )
                        spath.write_text(json.dumps(out_s, indent=1, ensure_ascii=False) + "\n")
                        print(f"{name}/{fmt}: {len(structured)} structured call(s) -> {spath}")
                chosen = pick(tap.records[before:])
                if chosen is None:
                    print(f"{name}/{fmt}: no model request recorded ({result.exit_reason})")
                    failed += 1
                    continue
                out = {
                    "harness": name,
                    "package": h.package,
                    "version": h.version,
                    "api_format": fmt,
                    "exit_reason": result.exit_reason,
                    "request": scrub(chosen, key),
                }
                suffix = "" if fmt == h.default_format else f".{fmt}"
                path = OUT_DIR / f"{name}{suffix}.json"
                path.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
                print(
                    f"{name}/{fmt}: {result.exit_reason}, recorded {chosen['method']} {out['request']['path']} -> {path}"
                )
    finally:
        tap.stop()
        proxy.stop()
        engine.stop()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
