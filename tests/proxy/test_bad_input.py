"""Bad input and engine failures: each gets an error in the caller's own format; the proxy stays healthy."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from proxy_formats import FORMATS, error_message, reply_text, request


def post(h: Any, s: dict[str, Any], fmt: str, text: str, **kw: Any) -> Any:
    path, body, headers = request(fmt, text, **kw)
    return h.run(h.client.post(f"/s/{s['key']}{path}", json=body, headers=headers))


def healthy(h: Any) -> None:
    r = h.run(h.client.get("/health"))
    assert r.status_code == 200 and r.json()["status"] == "ok"


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_round_trips_and_401s_in_its_own_shape(make_proxy: Any, fmt: str) -> None:
    h = make_proxy()
    s = h.session()
    r = post(h, s, fmt, "hello there")
    assert r.status_code == 200, r.text
    assert reply_text(fmt, r.json()) == "reply to: hello there"
    path, body, headers = request(fmt, "x")
    r = h.run(h.client.post(f"/s/not-a-key{path}", json=body, headers=headers))
    assert r.status_code == 401
    assert "unknown" in error_message(fmt, r.json())
    assert len(h.store.read_session(s["session_id"])["calls"]) == 1


@pytest.mark.parametrize("fmt", FORMATS)
def test_malformed_json_wrong_types_missing_fields(make_proxy: Any, fmt: str) -> None:
    h = make_proxy()
    s = h.session()
    path, body, headers = request(fmt, "x")
    url = f"/s/{s['key']}{path}"
    r = h.run(h.client.post(url, content=b'{"model": "m", "messages": [', headers=headers))
    assert r.status_code == 400 and "not valid JSON" in error_message(fmt, r.json())
    r = h.run(h.client.post(url, content=b"[1, 2]", headers=headers))
    assert r.status_code == 400 and "JSON object" in error_message(fmt, r.json())
    key = {
        "openai_chat": "messages",
        "openai_responses": "input",
        "anthropic_messages": "messages",
        "gemini": "contents",
    }[fmt]
    for bad in ({**body, key: 42}, {k: v for k, v in body.items() if k != key}, {**body, key: [{"role": 7}]}):
        r = h.run(h.client.post(url, json=bad, headers=headers))
        assert r.status_code == 400, (bad, r.text)
        error_message(fmt, r.json())
    assert h.engine.requests == []
    healthy(h)


@pytest.mark.parametrize("fmt", FORMATS)
def test_request_that_converts_to_no_messages_is_400_not_forwarded(make_proxy: Any, fmt: str) -> None:
    h = make_proxy()
    s = h.session()
    path, body, headers = request(fmt, "x")
    empty = {
        "openai_chat": {"messages": []},
        "openai_responses": {"input": []},
        "anthropic_messages": {"messages": []},
        "gemini": {"contents": [{"role": "user", "parts": []}]},
    }[fmt]
    r = h.run(h.client.post(f"/s/{s['key']}{path}", json={**body, **empty}, headers=headers))
    assert r.status_code == 400, r.text
    message = error_message(fmt, r.json())
    assert "is empty" in message or "no messages" in message, message
    assert h.engine.requests == [] and h.store.read_session(s["session_id"])["calls"] == []
    healthy(h)


@pytest.mark.parametrize("fmt", FORMATS)
def test_oversized_body_is_413(make_proxy: Any, fmt: str) -> None:
    h = make_proxy(max_body_bytes=4096)
    s = h.session()
    r = post(h, s, fmt, "y" * 5000)
    assert r.status_code == 413 and "limit of 4096 bytes" in error_message(fmt, r.json())
    assert h.engine.requests == []
    healthy(h)


def test_n_greater_than_one_is_refused(make_proxy: Any) -> None:
    h = make_proxy()
    s = h.session()
    path, body, _ = request("openai_chat", "x")
    r = h.run(h.client.post(f"/s/{s['key']}{path}", json={**body, "n": 3}))
    assert r.status_code == 400 and "n=1" in error_message("openai_chat", r.json()).replace(" ", "")
    path, body, _ = request("gemini", "x")
    r = h.run(h.client.post(f"/s/{s['key']}{path}", json={**body, "generationConfig": {"candidateCount": 2}}))
    assert r.status_code == 400
    error_message("gemini", r.json())
    assert h.engine.requests == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_engine_down_is_502_and_counted(make_proxy: Any, fmt: str) -> None:
    h = make_proxy(retries=2)
    s = h.session()
    h.engine.down = True
    r = post(h, s, fmt, "x")
    assert r.status_code == 502 and "unreachable" in error_message(fmt, r.json())
    h.engine.down = False
    assert post(h, s, fmt, "back").status_code == 200
    stats = h.admin("GET", f"/sessions/{s['session_id']}").json()
    assert stats["upstream_errors"] == 1 and stats["recorded_calls"] == 1 and stats["model_calls"] == 2


@pytest.mark.parametrize("fmt", FORMATS)
def test_engine_400_passes_through_and_500_retries_then_502(make_proxy: Any, fmt: str) -> None:
    h = make_proxy(retries=3)
    s = h.session()
    r = post(h, s, fmt, "FAIL400")
    assert r.status_code == 400 and "bad sampling parameter" in error_message(fmt, r.json())
    assert len(h.engine.requests) == 1
    r = post(h, s, fmt, "FAIL500")
    assert r.status_code == 502 and "engine exploded" in error_message(fmt, r.json())
    assert len(h.engine.requests) == 4  # one 400 (no retry) + three 500s
    assert h.store.read_session(s["session_id"])["calls"] == []
    healthy(h)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("stream", [False, True])
def test_context_overflow_ends_with_stop_reply_not_recorded(make_proxy: Any, fmt: str, stream: bool) -> None:
    h = make_proxy()
    s = h.session()
    r = post(h, s, fmt, "OVERFLOW", stream=stream)
    assert r.status_code == 200, r.text
    if stream:
        assert b"context window" in r.content
        assert r.headers["content-type"].startswith("text/event-stream")
    else:
        assert "context window" in reply_text(fmt, r.json())
    data = h.store.read_session(s["session_id"])
    assert data["calls"] == [] and [e["kind"] for e in data["events"]] == ["context_stop"]
    assert h.admin("GET", f"/sessions/{s['session_id']}").json()["context_stops"] == 1


def test_misaligned_or_missing_capture_is_flagged_context_only(make_proxy: Any) -> None:
    h = make_proxy()
    s = h.session()
    assert post(h, s, "openai_chat", "BADLOGPROBS").status_code == 200
    assert post(h, s, "openai_chat", "NOPROMPT").status_code == 200
    bad, noprompt = h.store.read_session(s["session_id"])["calls"]
    assert bad["logprobs"] is None and bad["logprobs_aligned"] is False
    assert any("position 0" in n for n in bad["notes"])
    assert noprompt["logprobs_aligned"] is False and noprompt["prompt_ids"] == []
    assert h.admin("GET", f"/sessions/{s['session_id']}").json()["flagged_calls"] == 2


@pytest.mark.parametrize("fmt", FORMATS)
def test_slow_engine_stream_gets_keepalives_then_full_events(make_proxy: Any, fmt: str) -> None:
    h = make_proxy(keepalive_seconds=0.05)
    h.engine.slow_s = 0.3
    s = h.session()
    r = post(h, s, fmt, "SLOW TOOL", stream=True, tools=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.content.startswith(b": keep-alive\n\n")
    # The first event after the keep-alives is the format's own first event.
    first = [line for line in r.content.split(b"\n") if line and not line.startswith(b":")][0]
    expected = {
        "anthropic_messages": b"event: message_start",
        "openai_responses": b"event: response.created",
    }.get(fmt)
    if expected is not None:
        assert first == expected, first
    else:
        assert first.startswith(b"data: {") and b'"error"' not in first, first
    assert b"bash" in r.content
    (call,) = h.store.read_session(s["session_id"])["calls"]
    assert call["finish_reason"] == "tool_calls" and call["stream"] is True


def test_engine_error_after_stream_committed_is_sent_as_error_event(make_proxy: Any) -> None:
    h = make_proxy(keepalive_seconds=0.01, retries=3)
    h.settings.retry_backoff_s = 0.05
    s = h.session()
    r = post(h, s, "anthropic_messages", "FAIL500", stream=True)
    assert r.status_code == 200
    assert b"event: error" in r.content and b"engine exploded" in r.content


def test_client_disconnect_mid_stream_keeps_record_and_proxy_healthy(make_proxy: Any) -> None:
    h = make_proxy(keepalive_seconds=0.02)
    h.engine.slow_s = 0.3
    s = h.session()
    path, body, headers = request("openai_chat", "SLOW", stream=True)
    raw = orjson.dumps(body)

    async def scenario() -> list[dict[str, Any]]:
        sent: list[dict[str, Any]] = []
        disconnected = asyncio.Event()
        received = False

        async def receive() -> dict[str, Any]:
            nonlocal received
            if not received:
                received = True
                return {"type": "http.request", "body": raw, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)
            if message["type"] == "http.response.body" and message.get("body"):
                disconnected.set()  # the agent hangs up after the first keep-alive
                raise OSError("client went away")

        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": f"/s/{s['key']}{path}",
            "raw_path": f"/s/{s['key']}{path}".encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"host", b"proxy.test")],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 80),
            "state": {},
        }
        try:
            await h.app(scope, receive, send)
        except OSError:
            pass
        proxy = h.app.state.proxy
        await asyncio.gather(*proxy.tasks)
        return sent

    sent = h.run(scenario())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    (call,) = h.store.read_session(s["session_id"])["calls"]
    assert call["prompt_ids"] == h.engine.prompt_ids(h.engine.requests[-1]["messages"])
    healthy(h)
    assert post(h, s, "openai_chat", "after").status_code == 200


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("stream", [False, True])
def test_budget_stop_in_every_format(make_proxy: Any, fmt: str, stream: bool) -> None:
    h = make_proxy(max_model_calls=1)
    s = h.session()
    assert post(h, s, fmt, "first").status_code == 200
    r = post(h, s, fmt, "second", stream=stream)
    assert r.status_code == 200
    if stream:
        assert r.headers["content-type"].startswith("text/event-stream")
        assert b"model calls it is allowed" in r.content
        assert (b"data: [DONE]" in r.content) == (fmt == "openai_chat")
    else:
        assert "model calls it is allowed" in reply_text(fmt, r.json())
    assert len(h.engine.requests) == 1
    assert [e["kind"] for e in h.store.read_session(s["session_id"])["events"]] == ["budget_stop"]


def test_429_is_retried_with_retry_after_then_recorded_once(make_proxy: Any) -> None:
    h = make_proxy(retries=3)
    h.settings.retry_backoff_s = 30.0  # Retry-After: 0 must win over the backoff
    s = h.session()
    h.engine.throttle = 2
    r = post(h, s, "openai_chat", "patience")
    assert r.status_code == 200 and reply_text("openai_chat", r.json()) == "reply to: patience"
    (call,) = h.store.read_session(s["session_id"])["calls"]
    assert call["timings"]["attempts"] == 3 and len(h.engine.requests) == 3


def test_body_that_never_arrives_times_out_with_408(make_proxy: Any) -> None:
    h = make_proxy(body_timeout_s=0.2)
    s = h.session()

    async def scenario() -> list[dict[str, Any]]:
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            await asyncio.sleep(3600)  # headers came, the body never does
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        path = f"/s/{s['key']}/v1/messages"
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 80), "state": {},
        }  # fmt: skip
        await asyncio.wait_for(h.app(scope, receive, send), 5)
        return sent

    sent = h.run(scenario())
    assert sent[0]["status"] == 408
    assert "did not arrive" in error_message("anthropic_messages", orjson.loads(sent[1]["body"]))
    healthy(h)
