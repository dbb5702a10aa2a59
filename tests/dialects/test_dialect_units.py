"""Detection, auxiliary routes, error bodies, stop replies, keep-alives and bad input per format."""

from __future__ import annotations

import json
from typing import Any

import pytest
from dialect_helpers import SERVED, completion, sse_payloads, validate_reply, validate_stream

from fineenvs.dialects import DIALECTS, DialectError, aux_response, aux_route, detect, stop_completion
from fineenvs.dialects._common import decode_reasoning, encode_reasoning, thinking_signature


@pytest.mark.parametrize(
    ("path", "headers", "body", "want"),
    [
        ("/v1/chat/completions", {}, {"input": "x"}, "openai_chat"),  # path wins over body
        ("/s/abc/v1/responses", {}, {}, "openai_responses"),
        ("/v1/messages?beta=true", {}, None, "anthropic_messages"),
        ("/s/k/v1/messages", {}, {"contents": []}, "anthropic_messages"),
        ("/v1beta/models/gemini-3.1-pro:streamGenerateContent?alt=sse", {}, None, "gemini"),
        ("/v1beta/models/m:generateContent", {}, None, "gemini"),
        ("/v1/models/m:GENERATECONTENT", {}, None, "gemini"),
        ("/v1/models/m:streamGenerateContent", {}, None, "gemini"),
        ("/other", {"Anthropic-Version": "2023-06-01"}, {"contents": []}, "anthropic_messages"),
        ("/other", {}, {"contents": [], "input": "x"}, "gemini"),
        ("/other", {}, {"input": "x"}, "openai_responses"),
        ("/other", {}, {"messages": []}, "openai_chat"),
        ("/other", {}, None, "openai_chat"),
    ],
)
def test_detect(path: str, headers: dict[str, str], body: dict[str, Any] | None, want: str) -> None:
    assert detect(path, headers, body) == want


@pytest.mark.parametrize(
    ("method", "path", "want"),
    [
        ("POST", "/v1/messages/count_tokens", "anthropic_count_tokens"),
        ("POST", "/s/k/v1/messages/count_tokens?beta=true", "anthropic_count_tokens"),
        ("POST", "/v1beta/models/g:countTokens", "gemini_count_tokens"),
        ("GET", "/v1/models", "models"),
        ("GET", "/s/k/v1/models/MODEL", "model"),
        ("HEAD", "/", "head_root"),
        ("HEAD", "/s/key", "head_root"),
        ("GET", "/api/v1/models", "lmstudio_models"),
        ("POST", "/api/show", "ollama_show"),
        ("GET", "/v1beta/models", "gemini_models"),
        ("GET", "/v1beta/models/gemini-x", "gemini_model"),
        ("POST", "/v1/messages", None),
        ("POST", "/v1/chat/completions", None),
        ("POST", "/v1beta/models/g:generateContent", None),
        ("POST", "/v1/models", None),
    ],
)
def test_aux_route(method: str, path: str, want: str | None) -> None:
    assert aux_route(path, method) == want


def test_aux_responses() -> None:
    body = {"messages": [{"role": "user", "content": "x" * 400}]}
    count = aux_response("anthropic_count_tokens", body, SERVED)["input_tokens"]
    assert 100 <= count <= 120  # ~4 characters per token over the JSON text
    assert aux_response("gemini_count_tokens", {"contents": []}, SERVED)["totalTokens"] >= 1
    listing = aux_response("models", None, SERVED)
    from anthropic.types import ModelInfo
    from openai.types import Model

    assert Model.model_validate(listing["data"][0]).id == SERVED
    assert ModelInfo.model_validate(listing["data"][0]).id == SERVED
    assert listing["has_more"] is False and listing["first_id"] == SERVED
    assert aux_response("model", None, SERVED)["id"] == SERVED
    assert aux_response("gemini_models", None, SERVED)["models"][0]["name"] == f"models/{SERVED}"
    assert (
        aux_response("ollama_show", {"model": "x"}, SERVED, context_length=4096)["parameters"]
        == "num_ctx 4096"
    )
    with pytest.raises(ValueError, match="unknown auxiliary route kind"):
        aux_response("nope", None, SERVED)


def test_error_bodies_in_each_format() -> None:
    chat = DIALECTS["openai_chat"].error_body(400, "bad")
    assert chat == {
        "error": {
            "message": "fineenvs proxy: bad",
            "type": "invalid_request_error",
            "param": None,
            "code": "400",
        }
    }
    assert DIALECTS["openai_responses"].error_body(401, "no key")["error"]["code"] == "invalid_api_key"
    assert DIALECTS["anthropic_messages"].error_body(413, "big") == {
        "type": "error",
        "error": {"type": "request_too_large", "message": "fineenvs proxy: big"},
    }
    assert DIALECTS["anthropic_messages"].error_body(503, "x")["error"]["type"] == "api_error"
    assert DIALECTS["gemini"].error_body(429, "slow") == {
        "error": {"code": 429, "message": "fineenvs proxy: slow", "status": "RESOURCE_EXHAUSTED"}
    }
    assert DIALECTS["gemini"].error_body(400, "fineenvs proxy: x", kind="FAILED_PRECONDITION")["error"] == {
        "code": 400,
        "message": "fineenvs proxy: x",
        "status": "FAILED_PRECONDITION",
    }


MINIMAL = {
    "openai_chat": ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, ""),
    "openai_responses": ({"model": "m", "input": "hi"}, ""),
    "anthropic_messages": (
        {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
        "",
    ),
    "gemini": ({"contents": [{"parts": [{"text": "hi"}]}]}, "/v1beta/models/g:generateContent"),
}


@pytest.mark.parametrize("api_format", list(DIALECTS))
def test_stop_reply_is_valid_and_non_empty(api_format: str) -> None:
    dialect = DIALECTS[api_format]
    body, path = MINIMAL[api_format]
    req = dialect.to_canonical(body, path=path, query={})
    text = "Budget exhausted: this attempt is over."
    reply = dialect.stop_reply(text, req, model=SERVED)
    validate_reply(api_format, reply)
    assert text in json.dumps(reply)
    events = validate_stream(
        api_format, b"".join(dialect.stream_events(stop_completion(text), req, model=SERVED))
    )
    assert events
    with pytest.raises(ValueError, match="non-empty"):
        stop_completion("")


def test_keepalives_are_sse_comments_in_every_format() -> None:
    # Sent before the format's first event, so never an event (Anthropic's ping included).
    for name in DIALECTS:
        raw = DIALECTS[name].keepalive()
        assert raw == b": keep-alive\n\n" and sse_payloads(raw) == []


@pytest.mark.parametrize("api_format", list(DIALECTS))
def test_length_finish_maps(api_format: str) -> None:
    dialect = DIALECTS[api_format]
    body, path = MINIMAL[api_format]
    req = dialect.to_canonical(body, path=path, query={})
    reply = dialect.from_chat_completion(completion(finish="length"), req, model=SERVED)
    want = {
        "openai_chat": lambda r: r["choices"][0]["finish_reason"] == "length",
        "openai_responses": lambda r: (
            r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
        ),
        "anthropic_messages": lambda r: r["stop_reason"] == "max_tokens",
        "gemini": lambda r: r["candidates"][0]["finishReason"] == "MAX_TOKENS",
    }[api_format]
    assert want(reply)
    if api_format == "openai_responses":
        events = sse_payloads(b"".join(dialect.stream_events(completion(finish="length"), req, model=SERVED)))
        assert events[-1][0] == "response.incomplete"


def test_chat_logprobs_only_when_asked() -> None:
    dialect = DIALECTS["openai_chat"]
    asked = dialect.to_canonical(
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True}, path="", query={}
    )
    reply = dialect.from_chat_completion(completion(), asked, model=SERVED)
    assert reply["choices"][0]["logprobs"] == {"content": [{"token": "token_id:7", "logprob": -0.5}]}


def test_signatures_are_deterministic_and_ours() -> None:
    assert thinking_signature("abc") == thinking_signature("abc") != thinking_signature("abd")
    assert thinking_signature("abc").startswith("fe:")
    assert decode_reasoning(encode_reasoning("héllo\nworld")) == "héllo\nworld"
    assert decode_reasoning("gAAAAAB-foreign") is None and decode_reasoning("fe:!!!") is None


def test_billing_header_as_first_line_of_string_system() -> None:
    req = DIALECTS["anthropic_messages"].to_canonical(
        {
            "model": "m",
            "max_tokens": 5,
            "messages": [{"role": "user", "content": "hi"}],
            "system": "x-anthropic-billing-header: cc_version=1; cch=abc;\nYou are Claude.",
        },
        path="",
        query={},
    )
    assert req.body["messages"][0] == {"role": "system", "content": "You are Claude."}
    assert any("billing header" in n for n in req.notes)


def test_anthropic_redacted_thinking_and_server_blocks() -> None:
    req = DIALECTS["anthropic_messages"].to_canonical(
        {
            "model": "m",
            "max_tokens": 5,
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "redacted_thinking", "data": encode_reasoning("secret plan")},
                        {"type": "redacted_thinking", "data": "EmwKAhgBEgy-real-anthropic"},
                        {
                            "type": "server_tool_use",
                            "id": "srvtoolu_1",
                            "name": "web_search",
                            "input": {"query": "x"},
                        },
                        {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []},
                        {"type": "text", "text": "found"},
                    ],
                },
                {"role": "user", "content": "thanks"},
            ],
        },
        path="",
        query={},
    )
    assert req.body["messages"][1] == {
        "role": "assistant",
        "content": "found",
        "reasoning_content": "secret plan",
    }
    assert sum("dropped" in n for n in req.notes) == 3


def test_malformed_engine_completion_is_a_502() -> None:
    for dialect in DIALECTS.values():
        body, path = MINIMAL[dialect.name]
        req = dialect.to_canonical(body, path=path, query={})
        with pytest.raises(DialectError) as err:
            dialect.from_chat_completion({"choices": []}, req, model=SERVED)
        assert err.value.status == 502 and "engine" in str(err.value)


BAD: list[tuple[str, Any, str]] = [
    ("openai_chat", [], "request body must be an object"),
    ("openai_chat", {"messages": "hi"}, "messages must be an array"),
    ("openai_chat", {"messages": []}, "messages is empty"),
    ("openai_chat", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role='wizard'"),
    ("openai_chat", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content must be"),
    ("openai_chat", {"messages": [{"role": "user", "content": "x"}], "n": 3}, "n=3 is not supported"),
    (
        "openai_chat",
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
        "max_tokens is out of range (got -1)",
    ),
    (
        "openai_chat",
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1e30},
        "an integer in [1, 2^63-1]",
    ),
    (
        "anthropic_messages",
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8, "temperature": 1.5},
        "temperature is out of range (got 1.5)",
    ),
    (
        "gemini",
        {"contents": [{"parts": [{"text": "x"}]}], "generationConfig": {"maxOutputTokens": 1.5e308}},
        "generationConfig.maxOutputTokens",
    ),
    (
        "openai_responses",
        {"input": "x", "top_p": -0.0},
        "top_p is out of range (got -0.0)",
    ),
    (
        "openai_chat",
        {"messages": [{"role": "tool", "content": "x"}]},
        "messages[0].tool_call_id must be a string",
    ),
    (
        "openai_chat",
        {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
        "'input_audio' is not",
    ),
    (
        "openai_chat",
        {"messages": [{"role": "user", "content": "x"}], "functions": []},
        "functions is not supported",
    ),
    (
        "openai_chat",
        {"messages": [{"role": "user", "content": "x"}], "stream": "yes"},
        "stream must be a boolean",
    ),
    ("openai_responses", {"input": 5}, "input must be an array"),
    ("openai_responses", {"input": []}, "input is empty"),
    (
        "openai_responses",
        {"input": "x", "previous_response_id": "resp_1"},
        "previous_response_id is not supported",
    ),
    (
        "openai_responses",
        {"input": [{"type": "local_shell_call", "call_id": "c"}]},
        "'local_shell_call' is not",
    ),
    (
        "openai_responses",
        {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
        "call_id must be",
    ),
    (
        "openai_responses",
        {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
        "input_image without image_url",
    ),
    ("openai_responses", {"input": "x", "tools": [{"type": "function"}]}, "tools[0].name must be a string"),
    ("anthropic_messages", {"messages": None}, "messages must be an array"),
    (
        "anthropic_messages",
        {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
        "'document' is not supported",
    ),
    (
        "anthropic_messages",
        {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
        "tool_use_id must be a string",
    ),
    (
        "anthropic_messages",
        {
            "messages": [
                {
                    "role": "assistant",
                    "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}],
                }
            ]
        },
        "image in an assistant message",
    ),
    (
        "anthropic_messages",
        {"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "maybe"}},
        "tool_choice.type='maybe'",
    ),
    (
        "anthropic_messages",
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "t", "input_schema": []}]},
        "input_schema must be an object",
    ),
    ("gemini", {"contents": {}}, "contents must be an array"),
    ("gemini", {"contents": [{"role": "narrator", "parts": []}]}, "role='narrator'"),
    (
        "gemini",
        {"contents": [{"parts": [{"inlineData": {"mimeType": "video/mp4", "data": "AA=="}}]}]},
        "media of type 'video/mp4'",
    ),
    (
        "gemini",
        {"contents": [{"parts": [{"text": "x"}]}], "generationConfig": {"candidateCount": 2}},
        "candidateCount=2 is not supported",
    ),
    (
        "gemini",
        {"contents": [{"parts": [{"text": "x"}]}], "cachedContent": "cachedContents/1"},
        "cachedContent",
    ),
    ("gemini", {"contents": [{"parts": [{"functionResponse": {"response": {}}}]}]}, "functionResponse.name"),
]


@pytest.mark.parametrize(("api_format", "body", "fragment"), BAD)
def test_bad_input_is_a_clear_400(api_format: str, body: Any, fragment: str) -> None:
    with pytest.raises(DialectError) as err:
        DIALECTS[api_format].to_canonical(body, path="/v1beta/models/g:generateContent", query={})
    assert err.value.status == 400
    message = str(err.value)
    assert fragment in message, message
    assert message.count(". ") >= 1 and ": " in message  # what: why. fix


def test_gemini_thought_parts_only_when_asked() -> None:
    dialect = DIALECTS["gemini"]
    path = "/v1beta/models/g:generateContent"
    plain = dialect.to_canonical({"contents": [{"parts": [{"text": "hi"}]}]}, path=path, query={})
    parts = dialect.from_chat_completion(completion(), plain, model=SERVED)["candidates"][0]["content"][
        "parts"
    ]
    assert [p.get("thought", False) for p in parts] == [False]
    assert parts[0]["text"] == "Hello from the engine." and parts[0]["thoughtSignature"]
    asked = dialect.to_canonical(
        {
            "contents": [{"parts": [{"text": "hi"}]}],
            "generationConfig": {"thinkingConfig": {"includeThoughts": True}},
        },
        path=path,
        query={},
    )
    parts = dialect.from_chat_completion(completion(), asked, model=SERVED)["candidates"][0]["content"][
        "parts"
    ]
    assert [p.get("thought", False) for p in parts] == [True, False]


def test_images_pass_through_as_chat_image_parts() -> None:
    url = "data:image/png;base64,iVBORw0KGgo="
    chat = DIALECTS["openai_chat"].to_canonical(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": url, "detail": "low"}},
                    ],
                }
            ]
        },
        path="",
        query={},
    )
    assert chat.body["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        }
    ]
    resp = DIALECTS["openai_responses"].to_canonical(
        {
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "what is this?"},
                        {"type": "input_image", "image_url": url},
                    ],
                }
            ]
        },
        path="",
        query={},
    )
    assert resp.body["messages"] == chat.body["messages"]
    anth = DIALECTS["anthropic_messages"].to_canonical(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
                        },
                    ],
                }
            ]
        },
        path="",
        query={},
    )
    assert anth.body["messages"] == chat.body["messages"]


def test_chat_sampling_fields_are_recorded_and_type_checked() -> None:
    dialect = DIALECTS["openai_chat"]
    req = dialect.to_canonical(
        {
            "messages": [{"role": "user", "content": "x"}],
            "temperature": 0,
            "top_p": 0.9,
            "stop": ["END"],
            "seed": 3,
            "user": "u1",
            "store": False,
        },
        path="",
        query={},
    )
    assert {k: req.body[k] for k in ("temperature", "top_p", "stop", "seed")} == {
        "temperature": 0,
        "top_p": 0.9,
        "stop": ["END"],
        "seed": 3,
    }
    assert "user" not in req.body and "store" not in req.body
    with pytest.raises(DialectError, match="temperature must be a number"):
        dialect.to_canonical(
            {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, path="", query={}
        )


@pytest.mark.parametrize(
    ("response", "want"),
    [
        ({"output": "hi\n"}, "hi\n"),
        ({"name": "bash", "content": "a.txt\n"}, "a.txt\n"),
        ({"error": "no such file"}, "[Tool Error] no such file"),
        ({"output": "partial", "error": "exit 1"}, '{"output": "partial", "error": "exit 1"}'),
        ({"files": ["a", "b"]}, '{"files": ["a", "b"]}'),
    ],
)
def test_gemini_function_response_text(response: dict[str, Any], want: str) -> None:
    req = DIALECTS["gemini"].to_canonical(
        {
            "contents": [
                {"role": "user", "parts": [{"text": "go"}]},
                {"role": "model", "parts": [{"functionCall": {"name": "t", "args": {}}}]},
                {"role": "user", "parts": [{"functionResponse": {"name": "t", "response": response}}]},
            ]
        },
        path="/v1beta/models/g:generateContent",
        query={},
    )
    assert req.body["messages"][-1] == {"role": "tool", "tool_call_id": "call_1_0", "content": want}
