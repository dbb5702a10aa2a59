"""Slow tier: the real proxy process (uvicorn) in front of real engines, driven by the official SDKs.

- Conformance: ``openai`` (chat + responses), ``anthropic`` and ``google-genai`` call the proxy in
  front of the embedded engine (``python -m fineenvs.engine serve --model tiny_qwen``), streaming
  and not, with tools; every reply and stream parses, and each recorded call holds the engine's
  own token ids (the prompt ids match what the engine reports for the recorded request, the
  sampled ids decode to the text the SDK received, one logprob <= 0 per sampled token).
- Durability: a proxy killed with SIGKILL while calls are in flight and restarted on the same
  store has lost no acknowledged call, and still accepts the old session keys.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from processes import stop, wait_ok
from tokenizers import Tokenizer

from benchmarks.common import RawConn, free_port
from fineenvs.paths import REPO_ROOT
from fineenvs_recipes.tiny import ensure_tiny_model

pytestmark = pytest.mark.slow
PY = sys.executable


def _start_proxy(engine_port: int, port: int, store: Path, *extra: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [PY, "-m", "fineenvs.proxy", "serve", "--engine-url", f"http://127.0.0.1:{engine_port}",
         "--served-model", "tiny_qwen", "--port", str(port), "--store-dir", str(store), *extra],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    wait_ok(f"http://127.0.0.1:{port}/health", 60)
    return proc


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    engine_port, proxy_port = free_port(), free_port()
    engine = subprocess.Popen(
        [PY, "-m", "fineenvs.engine", "serve", "--model", "tiny_qwen", "--port", str(engine_port),
         "--log-level", "warning"],
    )  # fmt: skip
    proxy = None
    try:
        wait_ok(f"http://127.0.0.1:{engine_port}/v1/models", 180)
        proxy = _start_proxy(engine_port, proxy_port, tmp_path_factory.mktemp("store"))
        yield {"engine": f"http://127.0.0.1:{engine_port}", "proxy": f"http://127.0.0.1:{proxy_port}"}
    finally:
        if proxy is not None:
            stop(proxy)
        stop(engine)


def _session(live: dict[str, Any], **meta: Any) -> dict[str, Any]:
    r = httpx.post(f"{live['proxy']}/sessions", json=meta)
    assert r.status_code == 201, r.text
    return dict(r.json())


def _check_records(live: dict[str, Any], session: dict[str, Any], texts: list[str]) -> None:
    """Every recorded call holds the engine's exact tokens for the text the SDK got back."""
    tok = Tokenizer.from_file(str(ensure_tiny_model("tiny_qwen") / "tokenizer.json"))
    rollout = httpx.get(f"{live['proxy']}/sessions/{session['session_id']}/rollout", timeout=60).json()
    calls = rollout["calls"]
    assert len(calls) == len(texts)
    for call, text in zip(calls, texts, strict=True):
        assert call["logprobs_aligned"] is True, call["notes"]
        assert len(call["logprobs"]) == len(call["sampled_ids"]) > 0
        assert all(lp <= 0 for lp in call["logprobs"])
        assert call["sampling_applied"]["temperature"] == 0.8
        if text:
            assert text.strip() in tok.decode(call["sampled_ids"], skip_special_tokens=False)
        # Re-ask the engine for the recorded request: it must report the very same prompt ids.
        probe = {
            "model": "tiny_qwen",
            "messages": call["request"]["messages"],
            "max_tokens": 1,
            "return_token_ids": True,
        }
        if call["request"].get("tools"):
            probe["tools"] = call["request"]["tools"]
        again = httpx.post(f"{live['engine']}/v1/chat/completions", json=probe, timeout=120).json()
        assert again["prompt_token_ids"] == call["prompt_ids"]
    assert rollout["trajectory"]["calls"], "the trajectory graph has the calls"


TOOL = {"name": "bash", "description": "Run a shell command.", "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}  # fmt: skip


def test_openai_chat_sdk(live: dict[str, Any]) -> None:
    import openai

    s = _session(live, harness="sdk-openai-chat")
    client = openai.OpenAI(base_url=f"{live['proxy']}/s/{s['key']}/v1", api_key="unused", max_retries=0)
    texts = []
    for stream in (False, True):
        kwargs: dict[str, Any] = {
            "model": "whatever",
            "messages": [{"role": "user", "content": "List the files."}],
            "tools": [{"type": "function", "function": TOOL}],
            "max_tokens": 12,
        }
        if stream:
            chunks = list(
                client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
            )
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
            texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
        else:
            reply = client.chat.completions.create(**kwargs)
            assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
            texts.append(reply.choices[0].message.content or "")
    _check_records(live, s, texts)


def test_openai_responses_sdk(live: dict[str, Any]) -> None:
    import openai

    s = _session(live, harness="sdk-openai-responses")
    client = openai.OpenAI(base_url=f"{live['proxy']}/s/{s['key']}/v1", api_key="unused", max_retries=0)
    texts = []
    tools = [{"type": "function", **TOOL}]
    reply = client.responses.create(model="m", input="List the files.", tools=tools, max_output_tokens=12)
    assert reply.status in ("completed", "incomplete")
    texts.append(reply.output_text)
    events = list(
        client.responses.create(
            model="m", input="List the files.", tools=tools, max_output_tokens=12, stream=True
        )
    )
    # A reply cut by max_output_tokens ends with response.incomplete, as OpenAI's own does.
    assert events[0].type == "response.created" and events[-1].type in (
        "response.completed",
        "response.incomplete",
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    texts.append(events[-1].response.output_text)
    _check_records(live, s, texts)


def test_anthropic_sdk(live: dict[str, Any]) -> None:
    import anthropic

    s = _session(live, harness="sdk-anthropic")
    client = anthropic.Anthropic(base_url=f"{live['proxy']}/s/{s['key']}", api_key="unused", max_retries=0)
    tools = [{"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["parameters"]}]
    kwargs: dict[str, Any] = {
        "model": "claude-opus-4-8",
        "max_tokens": 12,
        "system": [{"type": "text", "text": "You are terse."}],
        "messages": [{"role": "user", "content": "List the files."}],
        "tools": tools,
    }
    msg = client.messages.create(**kwargs)
    texts = ["".join(b.text for b in msg.content if b.type == "text")]
    assert msg.usage.output_tokens > 0
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    texts.append("".join(b.text for b in final.content if b.type == "text"))
    _check_records(live, s, texts)


def test_google_genai_sdk(live: dict[str, Any]) -> None:
    from google import genai
    from google.genai import types

    s = _session(live, harness="sdk-gemini")
    client = genai.Client(api_key=s["key"], http_options=types.HttpOptions(base_url=live["proxy"]))
    config = types.GenerateContentConfig(
        max_output_tokens=12,
        system_instruction="You are terse.",
        tools=[types.Tool(function_declarations=[types.FunctionDeclaration(
            name="bash", description="Run a shell command.", parameters_json_schema=TOOL["parameters"])])],
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
    )  # fmt: skip
    reply = client.models.generate_content(
        model="gemini-3.1-pro-preview", contents="List the files.", config=config
    )
    texts = ["".join(p.text or "" for p in reply.candidates[0].content.parts)]
    chunks = list(
        client.models.generate_content_stream(
            model="gemini-3.1-pro-preview", contents="List the files.", config=config
        )
    )
    assert chunks and chunks[-1].candidates[0].finish_reason is not None
    texts.append("".join(p.text or "" for c in chunks for p in (c.candidates[0].content.parts or [])))
    _check_records(live, s, texts)


# Bounded, so a random tiny model completes it well within max_tokens under the grammar.
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 12},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["title", "count"],
    "additionalProperties": False,
}


def _valid(text: str) -> dict[str, Any]:
    import json

    import jsonschema

    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    return dict(value)


def _constrained_records(live: dict[str, Any], session: dict[str, Any], n: int) -> None:
    calls = httpx.get(f"{live['proxy']}/sessions/{session['session_id']}/rollout", timeout=60).json()["calls"]
    assert len(calls) == n and all(c["constrained"] is True and c["requested_format"] for c in calls)
    # Recorded, aligned, but kept as context: the rows train on none of these tokens by default.
    assert all(c["logprobs_aligned"] for c in calls)


def test_structured_output_through_the_openai_sdk(live: dict[str, Any]) -> None:
    import openai
    from pydantic import BaseModel, Field

    class Title(BaseModel):
        title: str = Field(max_length=12)
        count: int = Field(ge=0, le=99)

    s = _session(live, harness="sdk-structured-openai")
    client = openai.OpenAI(base_url=f"{live['proxy']}/s/{s['key']}/v1", api_key="unused", max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "title", "schema": SCHEMA, "strict": True}}
    messages = [{"role": "user", "content": "Title this session."}]
    reply = client.chat.completions.create(model="m", messages=messages, response_format=fmt, max_tokens=120)
    _valid(reply.choices[0].message.content or "")
    chunks = list(
        client.chat.completions.create(
            model="m", messages=messages, response_format=fmt, max_tokens=120, stream=True
        )
    )
    _valid("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    parsed = client.chat.completions.parse(
        model="m", messages=messages, response_format=Title, max_tokens=120
    )
    assert isinstance(parsed.choices[0].message.parsed, Title)  # the SDK's own strict parse
    text_fmt = {"format": {"type": "json_schema", "name": "title", "schema": SCHEMA, "strict": True}}
    response = client.responses.create(
        model="m", input="Title this session.", text=text_fmt, max_output_tokens=120
    )
    _valid(response.output_text)
    events = list(
        client.responses.create(
            model="m", input="Title this session.", text=text_fmt, max_output_tokens=120, stream=True
        )
    )
    assert events[0].type == "response.created"
    _valid(events[-1].response.output_text)
    _constrained_records(live, s, 5)


def test_structured_output_through_the_anthropic_sdk(live: dict[str, Any]) -> None:
    import anthropic

    s = _session(live, harness="sdk-structured-anthropic")
    client = anthropic.Anthropic(base_url=f"{live['proxy']}/s/{s['key']}", api_key="unused", max_retries=0)
    kwargs: dict[str, Any] = {
        "model": "claude-opus-4-8",
        "max_tokens": 120,
        "messages": [{"role": "user", "content": "Title this session."}],
        "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
    }
    msg = client.messages.create(**kwargs)
    _valid("".join(b.text for b in msg.content if b.type == "text"))
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert events[0].type == "message_start"
    _valid("".join(b.text for b in final.content if b.type == "text"))
    _constrained_records(live, s, 2)


def test_structured_output_through_the_google_genai_sdk(live: dict[str, Any]) -> None:
    from google import genai
    from google.genai import types

    s = _session(live, harness="sdk-structured-gemini")
    client = genai.Client(api_key=s["key"], http_options=types.HttpOptions(base_url=live["proxy"]))
    config = types.GenerateContentConfig(
        max_output_tokens=120, response_mime_type="application/json", response_json_schema=SCHEMA
    )
    reply = client.models.generate_content(
        model="gemini-3.1-pro-preview", contents="Title this.", config=config
    )
    _valid(reply.text or "")
    chunks = list(
        client.models.generate_content_stream(
            model="gemini-3.1-pro-preview", contents="Title this.", config=config
        )
    )
    _valid("".join(c.text or "" for c in chunks))
    _constrained_records(live, s, 2)


def _structured_fixtures() -> list[tuple[str, str]]:
    from fineenvs.dialects import DIALECTS
    from tests.dialects.dialect_helpers import fixture_names, load_fixture
    from tests.harnesses.record_requests import is_structured

    return [(f, n) for f in DIALECTS for n in fixture_names(f) if is_structured(load_fixture(f, n)["body"])]


@pytest.mark.parametrize(("api_format", "name"), _structured_fixtures())
def test_recorded_structured_calls_are_served_and_parse_strictly(
    live: dict[str, Any], api_format: str, name: str
) -> None:
    """The agents' own structured-output calls (Claude Code's title, Gemini CLI's router, ...)
    replayed against the proxy in front of the embedded engine: served (the engine used to answer
    400), replies valid under the SDKs' strict models, recorded as constrained."""
    import copy

    from tests.dialects.dialect_helpers import load_fixture, validate_reply, validate_stream

    fx = load_fixture(api_format, name)
    s = _session(live, harness=f"replay-{name}")
    body = copy.deepcopy(fx["body"])
    headers = {**fx.get("headers", {}), "authorization": f"Bearer {s['key']}", "x-api-key": s["key"],
               "x-goog-api-key": s["key"]}  # fmt: skip
    reply = httpx.post(f"{live['proxy']}/s/{s['key']}{fx['path']}", json=body, headers=headers, timeout=300)
    assert reply.status_code == 200, reply.text
    streamed = reply.headers["content-type"].startswith("text/event-stream")
    if streamed:
        assert validate_stream(api_format, reply.content)
    else:
        validate_reply(api_format, reply.json())
    _constrained_records(live, s, 1)


HOSTILE = [b"1000000000000000000000000000000", b"1.5e308", b"1e400", b"NaN", b"-Infinity", b"-0.0"]


def test_hostile_numbers_get_the_callers_400_and_keep_the_connection(live: dict[str, Any]) -> None:
    """Over one keep-alive connection: a hostile number, then a normal call (the socket survives)."""
    import http.client
    import json

    s = _session(live, harness="hostile")
    port = int(live["proxy"].rsplit(":", 1)[1])
    shapes = {
        "/v1/chat/completions": (b'{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":%s}', "error"),
        "/v1/messages": (b'{"model":"m","max_tokens":%s,"messages":[{"role":"user","content":"x"}]}', "error"),
        "/v1/responses": (b'{"model":"m","input":"x","max_output_tokens":%s}', "error"),
        "/v1beta/models/g:generateContent": (
            b'{"contents":[{"parts":[{"text":"x"}]}],"generationConfig":{"maxOutputTokens":%s}}', "error"),
    }  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"content-type": "application/json", "authorization": f"Bearer {s['key']}", "x-api-key": s["key"],
               "x-goog-api-key": s["key"]}  # fmt: skip
    for path, (template, key) in shapes.items():
        for number in HOSTILE:
            conn.request("POST", f"/s/{s['key']}{path}", body=template % number, headers=headers)
            reply = conn.getresponse()
            body = reply.read()
            assert reply.status == 400, (path, number, reply.status, body)
            assert key in json.loads(body), body  # the format's own error shape
        ok = template % b"4"
        conn.request("POST", f"/s/{s['key']}{path}", body=ok, headers=headers)
        reply = conn.getresponse()
        assert reply.status == 200, (path, reply.read())
        reply.read()
    conn.close()


def test_sigkill_mid_run_loses_no_acknowledged_call(tmp_path: Path) -> None:
    from fineenvs.proxy.store import CallStore

    engine_port, proxy_port = free_port(), free_port()
    standin = subprocess.Popen(
        [PY, "-m", "benchmarks.servers", "standin", "--port", str(engine_port)], cwd=REPO_ROOT
    )
    store = tmp_path / "store"
    proxy = _start_proxy(engine_port, proxy_port, store, "--max-model-calls", "100000")
    acked: dict[str, set[str]] = {}
    try:
        sessions = [_session({"proxy": f"http://127.0.0.1:{proxy_port}"}) for _ in range(20)]

        async def agent(s: dict[str, Any]) -> None:
            conn = RawConn(proxy_port)
            for k in range(10_000):
                text = f"{s['session_id']} call {k}"
                body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}]})
                try:
                    status, _ = await conn.request("POST", f"/s/{s['key']}/v1/chat/completions", body)
                except (OSError, asyncio.IncompleteReadError):
                    return
                if status == 200:
                    acked.setdefault(s["session_id"], set()).add(text)

        async def run() -> None:
            tasks = [asyncio.create_task(agent(s)) for s in sessions]
            await asyncio.sleep(2.0)
            os.kill(proxy.pid, signal.SIGKILL)  # mid-run, calls in flight
            await asyncio.gather(*tasks)

        asyncio.run(run())
        proxy.wait(10)
        assert sum(len(v) for v in acked.values()) > 20
        reader = CallStore(store)
        for s in sessions:
            recorded = {
                c["request"]["messages"][-1]["content"] for c in reader.read_session(s["session_id"])["calls"]
            }
            assert acked.get(s["session_id"], set()) <= recorded
        reader.close()
        # The restarted proxy keeps the old sessions: keys work, counters and records continue.
        proxy = _start_proxy(engine_port, proxy_port, store, "--max-model-calls", "100000")
        s = sessions[0]
        r = httpx.post(
            f"http://127.0.0.1:{proxy_port}/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "after restart"}]},
            headers={"authorization": f"Bearer {s['key']}"},
        )
        assert r.status_code == 200, r.text
        stats = httpx.get(f"http://127.0.0.1:{proxy_port}/sessions/{s['session_id']}").json()
        assert stats["recorded_calls"] >= len(acked.get(s["session_id"], ())) + 1
        calls = httpx.get(
            f"http://127.0.0.1:{proxy_port}/sessions/{s['session_id']}/rollout", timeout=60
        ).json()["calls"]
        assert calls[-1]["request"]["messages"][-1]["content"] == "after restart"
        assert len({c["call_id"] for c in calls}) == len(calls)
    finally:
        stop(proxy)
        stop(standin)
