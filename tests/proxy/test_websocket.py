"""The Responses WebSocket transport, replaying the frames recorded from the real Codex CLI.

tests/fixtures/websocket/codex.json holds one Codex 0.171.0 connection (written by
tests/harnesses/record_websocket.py): a warm-up ``response.create`` with ``generate: false``, the
first turn as a delta on the warm-up, and the turn after the tool call as a delta (one
``function_call_output`` item). The frames go to the in-process proxy (Starlette's WebSocket test
client, fake engine behind); ``previous_response_id`` is rewritten to the id the proxy answered,
as Codex does. Checked: the warm-up costs no model call; each turn reaches the engine with the
full history, exactly as the same conversation sent over HTTP; every event frame parses as the
OpenAI SDK's stream event; records carry the engine's ids and ``transport: websocket``; budget,
engine failures, unknown keys and bad frames are answered in the Responses format. One slow test
replays the frames through the real proxy process (uvicorn, ``websockets`` client, compression).
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient, WebSocketDenialResponse, WebSocketTestSession

from fineenvs.proxy.app import BUDGET_TEXT

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "websocket" / "codex.json"
RECORDED = json.loads(FIXTURE.read_text())
CONNECTION = RECORDED["connections"][0]
CLIENT_FRAMES = [f["data"] for f in CONNECTION["frames"] if f["from"] == "client"]
# The upgrade's own headers, minus what the test client sets itself.
HEADERS = {
    k: v
    for k, v in CONNECTION["headers"].items()
    if k not in ("authorization", "upgrade", "sec-websocket-version", "sec-websocket-extensions")
}
TERMINAL = ("response.completed", "response.incomplete", "error")


@pytest.fixture
def client(make_proxy: Callable[..., Any]) -> Iterator[tuple[TestClient, Any]]:
    h = make_proxy()
    with TestClient(h.app, base_url="http://proxy.test") as c:
        yield c, h


def _session(c: TestClient, **payload: Any) -> dict[str, Any]:
    r = c.post("/sessions", json=payload)
    assert r.status_code == 201, r.text
    return dict(r.json())


def _exchange(ws: WebSocketTestSession, frame: dict[str, Any]) -> list[dict[str, Any]]:
    ws.send_text(json.dumps(frame))
    events: list[dict[str, Any]] = []
    while not events or events[-1]["type"] not in TERMINAL:
        events.append(ws.receive_json())
    return events


def _replay(ws: WebSocketTestSession) -> list[list[dict[str, Any]]]:
    """Every recorded client frame in order, ``previous_response_id`` pointed at our last answer."""
    answers: list[list[dict[str, Any]]] = []
    last_id = None
    for recorded in CLIENT_FRAMES:
        frame = copy.deepcopy(recorded)
        if "previous_response_id" in frame:
            frame["previous_response_id"] = last_id
        events = _exchange(ws, frame)
        last_id = events[-1].get("response", {}).get("id")
        answers.append(events)
    return answers


def _full_inputs(answers: list[list[dict[str, Any]]]) -> list[list[Any]]:
    """The full input of each replayed turn, as Codex would post it over HTTP: each delta
    expanded with the input before it and the output the proxy answered."""
    outputs = [events[-1]["response"]["output"] for events in answers]
    full: list[list[Any]] = []
    previous: list[Any] = []
    for frame, output_before in zip(CLIENT_FRAMES, [[], *outputs], strict=False):
        base = [*previous, *output_before] if "previous_response_id" in frame else []
        previous = [*base, *frame["input"]]
        full.append(previous)
    return full


def test_fixture_is_codex_default_transport() -> None:
    assert CONNECTION["path"] == "/s/SESSION_KEY/v1/responses"
    assert CONNECTION["headers"]["openai-beta"].startswith("responses_websockets=")
    assert CONNECTION["headers"]["authorization"] == "<scrubbed>"
    assert RECORDED["version"] == "0.171.0"
    kinds = [(f.get("generate"), "previous_response_id" in f) for f in CLIENT_FRAMES]
    assert kinds == [(False, False), (None, True), (None, True)]
    assert CLIENT_FRAMES[2]["input"][0]["type"] == "function_call_output"


def test_recorded_codex_frames_replay(client: tuple[TestClient, Any]) -> None:
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    c, h = client
    s = _session(c, harness="codex")
    with c.websocket_connect(f"/s/{s['key']}/v1/responses", headers=HEADERS) as ws:
        warmup, first, second = _replay(ws)

    # The warm-up: an empty response and no model call.
    assert [e["type"] for e in warmup] == ["response.created", "response.completed"]
    assert warmup[-1]["response"]["output"] == []
    assert len(h.engine.requests) == 2  # the two real turns only

    adapter: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
    for events in (warmup, first, second):
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        for e in events:
            adapter.validate_python(e)
        assert events[-1]["type"] == "response.completed"
    assert [e["type"] for e in first][:2] == ["response.created", "response.in_progress"]
    assert "reply to:" in json.dumps(first[-1]["response"]["output"])

    # The second turn reached the engine with the whole history: the first turn's messages, the
    # assistant's reply, then the tool output Codex sent as the only new item.
    m0, m1 = (r["messages"] for r in h.engine.requests)
    assert m1[: len(m0)] == m0
    assert m1[len(m0)]["role"] == "assistant" and "reply to:" in json.dumps(m1[len(m0)])
    assert m1[-1]["role"] == "tool"
    assert m1[-1]["content"] == CLIENT_FRAMES[2]["input"][0]["output"]

    # Records: the engine's own ids, the transport, and a prefix chain like any HTTP session.
    rollout = c.get(f"/sessions/{s['session_id']}/rollout").json()
    calls = rollout["calls"]
    assert [call["transport"] for call in calls] == ["websocket", "websocket"]
    assert [call["dialect"] for call in calls] == ["openai_responses"] * 2
    for call, req in zip(calls, h.engine.requests, strict=True):
        assert call["prompt_ids"] == h.engine.prompt_ids(req["messages"])
        assert call["logprobs"] and all(lp <= 0 for lp in call["logprobs"])
    chain = calls[0]["prompt_ids"] + calls[0]["sampled_ids"]
    assert calls[1]["prompt_ids"][: len(chain)] == chain
    assert calls[0]["harness_ids"]["session-id"] == CONNECTION["headers"]["session-id"]


def test_websocket_turns_equal_the_same_conversation_over_http(
    make_proxy: Callable[..., Any], tmp_path: Path
) -> None:
    ws_proxy, http_proxy = make_proxy(), make_proxy(store_dir=tmp_path / "store-http")
    with TestClient(ws_proxy.app, base_url="http://proxy.test") as c:
        s = _session(c)
        with c.websocket_connect(f"/s/{s['key']}/v1/responses", headers=HEADERS) as ws:
            answers = _replay(ws)
    with TestClient(http_proxy.app, base_url="http://proxy.test") as c:
        s = _session(c)
        for frame, full in list(zip(CLIENT_FRAMES, _full_inputs(answers), strict=True))[1:]:
            body = {k: v for k, v in frame.items() if k not in ("type", "previous_response_id", "generate")}
            r = c.post(f"/s/{s['key']}/v1/responses", json={**body, "input": full})
            assert r.status_code == 200, r.text
    assert len(ws_proxy.engine.requests) == len(http_proxy.engine.requests) == 2
    for over_ws, over_http in zip(ws_proxy.engine.requests, http_proxy.engine.requests, strict=True):
        assert over_ws["messages"] == over_http["messages"]
        assert over_ws.get("tools") == over_http.get("tools")


def test_unknown_key_and_wrong_path_are_refused_in_the_responses_format(
    client: tuple[TestClient, Any],
) -> None:
    c, _h = client
    with pytest.raises(WebSocketDenialResponse) as denied:
        with c.websocket_connect("/s/not-a-key/v1/responses"):
            pass
    assert denied.value.status_code == 401
    error = denied.value.json()["error"]
    assert error["message"].startswith("fineenvs proxy:") and "unknown or closed" in error["message"]
    with pytest.raises(WebSocketDenialResponse) as missing:
        with c.websocket_connect("/v1/responses"):
            pass
    assert missing.value.status_code == 401 and "no session key" in missing.value.json()["error"]["message"]
    s = _session(c)
    with pytest.raises(WebSocketDenialResponse) as wrong:
        with c.websocket_connect(f"/s/{s['key']}/v1/chat/completions"):
            pass
    assert wrong.value.status_code == 404


def test_bearer_key_works_without_a_path_prefix(client: tuple[TestClient, Any]) -> None:
    c, h = client
    s = _session(c)
    frame = {**copy.deepcopy(CLIENT_FRAMES[0]), "generate": None}
    with c.websocket_connect("/v1/responses", headers={"authorization": f"Bearer {s['key']}"}) as ws:
        events = _exchange(ws, {k: v for k, v in frame.items() if v is not None})
    assert events[-1]["type"] == "response.completed" and len(h.engine.requests) == 1


def test_bad_frames_get_error_frames_and_the_connection_stays_usable(client: tuple[TestClient, Any]) -> None:
    c, h = client
    s = _session(c)
    with c.websocket_connect(f"/s/{s['key']}/v1/responses", headers=HEADERS) as ws:
        ws.send_text("{not json")
        bad = ws.receive_json()
        assert bad["type"] == "error" and bad["status"] == 400 and "not valid JSON" in bad["error"]["message"]
        ws.send_text(json.dumps({"type": "response.append", "input": []}))
        unsupported = ws.receive_json()
        assert unsupported["status"] == 400 and "response.append" in unsupported["error"]["message"]
        stale = {**copy.deepcopy(CLIENT_FRAMES[1]), "previous_response_id": "resp_gone"}
        (missing,) = _exchange(ws, stale)
        assert missing["status"] == 400 and missing["error"]["code"] == "previous_response_not_found"
        ws.send_text(json.dumps({"type": "response.processed", "response_id": "resp_gone"}))  # no answer
        events = _replay(ws)
    assert all(e[-1]["type"] == "response.completed" for e in events)
    assert len(h.engine.requests) == 2


def test_budget_and_engine_failure_over_websocket(client: tuple[TestClient, Any]) -> None:
    c, h = client
    s = _session(c, max_model_calls=1)
    turn = {k: v for k, v in copy.deepcopy(CLIENT_FRAMES[1]).items() if k != "previous_response_id"}
    failing = copy.deepcopy(turn)
    failing["input"].append(
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "FAIL500"}]}
    )
    with c.websocket_connect(f"/s/{s['key']}/v1/responses", headers=HEADERS) as ws:
        (error,) = _exchange(ws, failing)
        stopped = _exchange(ws, turn)
    assert error["type"] == "error" and error["status"] == 502
    assert error["error"]["type"] == "server_error" and "engine" in error["error"]["message"]
    # The failed call used the one allowed call; the next is answered by the proxy itself.
    assert stopped[-1]["type"] == "response.completed"
    assert BUDGET_TEXT.format(n=1)[:40] in json.dumps(stopped[-1]["response"]["output"])
    stats = c.get(f"/sessions/{s['session_id']}").json()
    assert stats["budget_stops"] == 1 and stats["upstream_errors"] == 1


@pytest.mark.slow
def test_real_proxy_process_over_a_real_socket(tmp_path: Path) -> None:
    """uvicorn + the ``websockets`` client with permessage-deflate, as Codex connects."""
    import asyncio

    from websockets.asyncio.client import connect

    from tests.harnesses.scripted_engine import ScriptedEngine
    from tests.harnesses.stack import start_proxy

    engine = ScriptedEngine().start()
    proxy = start_proxy(engine.url, "tiny_qwen", tmp_path / "store")
    try:
        s = proxy.new_session(harness="codex")
        url = proxy.url.replace("http://", "ws://") + f"/s/{s['key']}/v1/responses"

        async def run() -> list[list[dict[str, Any]]]:
            answers = []
            async with connect(url, additional_headers=HEADERS, compression="deflate") as ws:
                last_id = None
                for recorded in CLIENT_FRAMES:
                    frame = copy.deepcopy(recorded)
                    if "previous_response_id" in frame:
                        frame["previous_response_id"] = last_id
                    await ws.send(json.dumps(frame))
                    events: list[dict[str, Any]] = []
                    while not events or events[-1]["type"] not in TERMINAL:
                        events.append(json.loads(await ws.recv()))
                    last_id = events[-1]["response"]["id"]
                    answers.append(events)
            return answers

        answers = asyncio.run(run())
        calls = proxy.rollout(s["session_id"])["calls"]
    finally:
        proxy.stop()
        engine.stop()
    assert [a[-1]["type"] for a in answers] == ["response.completed"] * 3
    # The scripted policy calls the shell tool first, then answers once the tool output is back.
    assert any(e["type"] == "response.function_call_arguments.done" for e in answers[1])
    assert "42" in json.dumps(answers[2][-1]["response"]["output"])
    assert len(calls) == 2 and {c["transport"] for c in calls} == {"websocket"}
    assert all((tuple(c["prompt_ids"]), tuple(c["sampled_ids"])) in engine.replies for c in calls)


def test_a_client_that_leaves_mid_call_still_gets_its_call_recorded(client: tuple[TestClient, Any]) -> None:
    c, h = client
    s = _session(c)
    turn = {k: v for k, v in copy.deepcopy(CLIENT_FRAMES[1]).items() if k != "previous_response_id"}
    turn["input"].append(
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "SLOW"}]}
    )
    with c.websocket_connect(f"/s/{s['key']}/v1/responses", headers=HEADERS) as ws:
        ws.send_text(json.dumps(turn))
        ws.close()  # before the engine (0.3 s) has answered
    deadline = time.monotonic() + 10
    calls: list[Any] = []
    while not calls and time.monotonic() < deadline:  # the call finishes after the client left
        time.sleep(0.05)
        calls = c.get(f"/sessions/{s['session_id']}/rollout").json()["calls"]
    assert len(h.engine.requests) == 1 and len(calls) == 1
    assert calls[0]["transport"] == "websocket" and calls[0]["sampled_ids"]
