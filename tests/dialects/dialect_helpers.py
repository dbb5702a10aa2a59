"""Shared by the dialect tests: canned engine completions and an httpx handler that plays the
proxy's conversion path (detect -> to_canonical -> canned completion -> reply or stream)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import httpx

from fineenvs.dialects import DIALECTS, CanonicalRequest, DialectError, detect

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
SERVED = "served-model"
ENGINE_TEXT = "Hello from the engine."
ENGINE_REASONING = "The user wants a greeting; a shell call shows it works."
TOOL_ARGS = {"command": "echo hi", "timeout": 5}


def completion(
    *,
    tool: str | None = None,
    reasoning: str = ENGINE_REASONING,
    content: str = ENGINE_TEXT,
    finish: str | None = None,
) -> dict[str, Any]:
    """A finished vLLM-style completion, with the engine-only fields a reply must not leak."""
    message: dict[str, Any] = {"role": "assistant", "content": content, "reasoning": reasoning or None}
    if tool:
        message["tool_calls"] = [
            {
                "id": "chatcmpl-tool-7f3a",
                "type": "function",
                "function": {"name": tool, "arguments": json.dumps(TOOL_ARGS)},
            }
        ]
    return {
        "id": "chatcmpl-42",
        "object": "chat.completion",
        "created": 1764460800,
        "model": "/models/served",
        "prompt_token_ids": [1, 2, 3],
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish or ("tool_calls" if tool else "stop"),
                "token_ids": [7, 8, 9],
                "logprobs": {"content": [{"token": "token_id:7", "logprob": -0.5}]},
            }
        ],
        "usage": {
            "prompt_tokens": 120,
            "completion_tokens": 30,
            "total_tokens": 150,
            "prompt_tokens_details": {"cached_tokens": 100},
            "completion_tokens_details": None,
        },
    }


def first_tool(request: CanonicalRequest) -> str | None:
    tools = request.body.get("tools") or []
    return tools[0]["function"]["name"] if tools else None


class FakeProxy:
    """An httpx handler converting each call through the dialect modules (what the proxy does)."""

    def __init__(self) -> None:
        self.requests: list[CanonicalRequest] = []
        self.formats: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        # The anthropic SDK runs on httpx2, the others on httpx: answer in the caller's library.
        lib: Any = sys.modules[type(request).__module__.split(".")[0]]
        body = json.loads(request.content) if request.content else None
        path = request.url.path
        query = dict(parse_qsl(request.url.query.decode()))
        name = detect(
            path + ("?" + request.url.query.decode() if request.url.query else ""), request.headers, body
        )
        dialect = DIALECTS[name]
        try:
            canonical = dialect.to_canonical(body, path=path, query=query)  # type: ignore[arg-type]
        except DialectError as err:
            return lib.Response(err.status, json=dialect.error_body(err.status, str(err)))
        self.requests.append(canonical)
        self.formats.append(name)
        done = completion(tool=first_tool(canonical))
        if canonical.stream:
            content = b"".join(dialect.stream_events(done, canonical, model=SERVED))
            return lib.Response(200, content=content, headers={"content-type": "text/event-stream"})
        return lib.Response(200, json=dialect.from_chat_completion(done, canonical, model=SERVED))


def load_fixture(api_format: str, name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / api_format / name).read_text())


def fixture_names(api_format: str) -> list[str]:
    return sorted(p.name for p in (FIXTURES / api_format).glob("*.json"))


def sse_payloads(raw: bytes) -> list[tuple[str | None, Any]]:
    """(event name, parsed data) per SSE event; ``[DONE]`` comes back as the string."""
    out: list[tuple[str | None, Any]] = []
    for block in raw.decode().replace("\r\n", "\n").split("\n\n"):
        if not block.strip() or block.startswith(":"):
            continue
        event = None
        data = []
        for line in block.split("\n"):
            if line.startswith("event: "):
                event = line[len("event: ") :]
            elif line.startswith("data: "):
                data.append(line[len("data: ") :])
            else:
                raise AssertionError(f"unexpected SSE line {line!r}")
        text = "\n".join(data)
        out.append((event, text if text == "[DONE]" else json.loads(text)))
    return out


def validate_reply(api_format: str, body: dict[str, Any]) -> Any:
    """Strict validation with the official SDK's own models (stricter than the SDKs' lenient parse)."""
    from anthropic.types import Message
    from google.genai.types import GenerateContentResponse
    from openai.types.chat import ChatCompletion
    from openai.types.responses import Response

    model = {
        "openai_chat": ChatCompletion,
        "openai_responses": Response,
        "anthropic_messages": Message,
        "gemini": GenerateContentResponse,
    }[api_format]
    return model.model_validate(body)  # type: ignore[attr-defined]


def validate_stream(api_format: str, raw: bytes) -> list[Any]:
    """Parse and strictly validate every event of a stream; returns the SDK objects."""
    import pydantic
    from anthropic.types import RawMessageStreamEvent
    from google.genai.types import GenerateContentResponse
    from openai.types.chat import ChatCompletionChunk
    from openai.types.responses import ResponseStreamEvent

    events = sse_payloads(raw)
    if api_format == "openai_chat":
        assert events[-1] == (None, "[DONE]") and all(e is None for e, _ in events)
        return [ChatCompletionChunk.model_validate(p) for _, p in events[:-1]]
    assert all(p != "[DONE]" for _, p in events), "only chat streams end with [DONE]"
    if api_format == "gemini":
        return [GenerateContentResponse.model_validate(p) for _, p in events]
    adapter: Any = pydantic.TypeAdapter(
        RawMessageStreamEvent if api_format == "anthropic_messages" else ResponseStreamEvent
    )
    parsed = []
    for event, payload in events:
        assert event == payload["type"], "the SSE event name must match the payload type"
        parsed.append(adapter.validate_python(payload))
    return parsed
