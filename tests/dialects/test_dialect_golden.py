"""Golden request fixtures (tests/fixtures/<api_format>/*.json), built from the shapes each real
harness sends (shared/reference/harnesses.md), converted both ways.

Request -> canonical is compared with hand-written expectations; a canned engine completion ->
the caller's reply and stream is validated strictly with the official SDK models, with the tool
call mapped back to the caller's own tool name.
"""

from __future__ import annotations

import copy
import json
from typing import Any
from urllib.parse import parse_qsl

import pytest
from dialect_helpers import (
    ENGINE_TEXT,
    SERVED,
    TOOL_ARGS,
    completion,
    first_tool,
    fixture_names,
    load_fixture,
    validate_reply,
    validate_stream,
)

from fineenvs.dialects import DIALECTS, detect

CASES = [(f, n) for f in DIALECTS for n in fixture_names(f)]


def _convert(api_format: str, fx: dict[str, Any]) -> Any:
    path, _, query = fx["path"].partition("?")
    return DIALECTS[api_format].to_canonical(
        copy.deepcopy(fx["body"]), path=path, query=dict(parse_qsl(query))
    )


def test_every_format_has_fixtures() -> None:
    for api_format in DIALECTS:
        assert len(fixture_names(api_format)) >= 3, api_format


@pytest.mark.parametrize(("api_format", "name"), CASES)
def test_request_to_canonical(api_format: str, name: str) -> None:
    fx = load_fixture(api_format, name)
    exp = fx["expect"]
    assert detect(fx["path"], fx.get("headers", {}), fx["body"]) == api_format == exp["format"]
    before = copy.deepcopy(fx["body"])
    req = _convert(api_format, fx)
    assert fx["body"] == before, "conversion must not mutate the agent's body"
    assert req.body["messages"] == exp["messages"]
    assert [t["function"]["name"] for t in req.body.get("tools", [])] == exp["tools"]
    for key, value in exp.get("body", {}).items():
        assert req.body[key] == value, key
    for key in [*exp.get("absent", []), "stream", "stream_options", "model", "n"]:
        assert key not in req.body, key
    for fragment in exp["notes"]:
        assert any(fragment in note for note in req.notes), (fragment, req.notes)
    if not exp["notes"]:
        assert req.notes == []
    for key, value in exp.get("state", {}).items():
        assert req.state[key] == value, key
    assert req.stream is exp["stream"] and req.model == exp["model"]
    assert json.loads(json.dumps(req.body)) == req.body and json.dumps(req.state)
    assert _convert(api_format, fx) == req, "conversion must be deterministic"


@pytest.mark.parametrize(("api_format", "name"), CASES)
def test_completion_to_reply_and_stream(api_format: str, name: str) -> None:
    fx = load_fixture(api_format, name)
    req = _convert(api_format, fx)
    dialect = DIALECTS[api_format]
    tool = first_tool(req)
    done = completion(tool=tool)
    reply = dialect.from_chat_completion(done, req, model=SERVED)
    parsed = validate_reply(api_format, reply)
    text = json.dumps(reply)
    assert ENGINE_TEXT in text and SERVED in text
    assert "prompt_token_ids" not in text and "token_ids" not in text
    events = validate_stream(api_format, b"".join(dialect.stream_events(done, req, model=SERVED)))
    assert events
    if tool:
        want = fx["reply_tool"]
        calls = _calls(api_format, parsed)
        assert len(calls) == 1 and calls[0][0] == want["name"] and calls[0][1] == want.get("namespace")
        assert calls[0][2] == TOOL_ARGS


def _calls(api_format: str, parsed: Any) -> list[tuple[str, str | None, Any]]:
    if api_format == "openai_chat":
        return [
            (c.function.name, None, json.loads(c.function.arguments))
            for c in parsed.choices[0].message.tool_calls or []
        ]
    if api_format == "openai_responses":
        out = []
        for item in parsed.output:
            if item.type == "function_call":
                out.append((item.name, item.namespace, json.loads(item.arguments)))
            elif item.type == "custom_tool_call":
                out.append((item.name, item.namespace, json.loads(item.input)))
        return out
    if api_format == "anthropic_messages":
        return [(b.name, None, b.input) for b in parsed.content if b.type == "tool_use"]
    return [
        (p.function_call.name, None, p.function_call.args)
        for p in parsed.candidates[0].content.parts
        if p.function_call
    ]
