"""Real requests recorded from every harness CLI we run (tests/fixtures/harness_records/, written by
tests/harnesses/record_requests.py through the real proxy; keys scrubbed), converted both ways:
detected as the harness's own format, converted to a canonical chat request deterministically
(prefix stability: the same body gives the same messages), and a canned engine completion
converted back into a reply and a full stream that the official SDK models accept."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import pytest
from dialect_helpers import ENGINE_TEXT, SERVED, completion, first_tool, validate_reply, validate_stream

from fineenvs.dialects import DIALECTS, aux_route, detect

RECORDS = sorted((Path(__file__).parent.parent / "fixtures" / "harness_records").glob("*.json"))
HARNESSES = {"claude_code", "codex", "opencode", "mini_swe_agent", "hermes", "pi", "gemini_cli", "qwen_code",
             "copilot", "kilo", "droid", "aider", "kimi_code", "cline", "gptme", "mistral_vibe",
             "openhands"}  # fmt: skip


def _strip_prefix(path: str) -> str:
    # Agents call /s/<key>/... ; the dialect sees the path after the session prefix.
    if path.startswith("/s/"):
        return "/" + path.split("/", 3)[3]
    return path


def test_every_harness_has_a_recorded_request() -> None:
    recorded = {json.loads(p.read_text())["harness"] for p in RECORDS}
    assert HARNESSES <= recorded, HARNESSES - recorded
    formats = {json.loads(p.read_text())["api_format"] for p in RECORDS}
    assert formats == set(DIALECTS)


@pytest.mark.parametrize("record", RECORDS, ids=[p.stem for p in RECORDS])
def test_recorded_request_both_ways(record: Path) -> None:
    data = json.loads(record.read_text())
    req: dict[str, Any] = data["request"]
    full_path = _strip_prefix(req["path"])
    path, _, query = full_path.partition("?")
    body = req["body"]
    assert aux_route(path, req["method"]) is None
    assert detect(full_path, req["headers"], body) == data["api_format"]
    dialect = DIALECTS[data["api_format"]]
    canonical = dialect.to_canonical(copy.deepcopy(body), path=path, query=dict(parse_qsl(query)))
    again = dialect.to_canonical(copy.deepcopy(body), path=path, query=dict(parse_qsl(query)))
    assert canonical == again, "conversion must be deterministic (prefix linking depends on it)"
    messages = canonical.body["messages"]
    assert messages and all(m["role"] in ("system", "user", "assistant", "tool") for m in messages)
    assert json.loads(json.dumps(canonical.body)) == canonical.body
    for key in ("stream", "stream_options", "n", "model"):
        assert key not in canonical.body, key
    if data["harness"] == "claude_code":
        assert "x-anthropic-billing-header" not in json.dumps(messages), (
            "the per-request nonce line is stripped"
        )
    tool = first_tool(canonical)
    done = completion(tool=tool)
    reply = dialect.from_chat_completion(done, canonical, model=SERVED)
    validate_reply(data["api_format"], reply)
    assert ENGINE_TEXT in json.dumps(reply)
    if canonical.stream:
        events = validate_stream(
            data["api_format"], b"".join(dialect.stream_events(done, canonical, model=SERVED))
        )
        assert events
