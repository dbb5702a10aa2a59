"""Minimal valid requests in each of the four formats, and readers for their replies and errors."""

from __future__ import annotations

from typing import Any

FORMATS = ("openai_chat", "openai_responses", "anthropic_messages", "gemini")


def request(
    fmt: str, text: str, *, stream: bool = False, tools: bool = False
) -> tuple[str, dict[str, Any], dict[str, str]]:
    """(path, body, headers) of a one-user-message call in ``fmt``."""
    if fmt == "openai_chat":
        body: dict[str, Any] = {
            "model": "m",
            "messages": [{"role": "user", "content": text}],
            "stream": stream,
        }
        if tools:
            body["tools"] = [
                {"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}
            ]
        return "/v1/chat/completions", body, {}
    if fmt == "openai_responses":
        body = {"model": "m", "input": [{"role": "user", "content": text}], "stream": stream}
        if tools:
            body["tools"] = [{"type": "function", "name": "bash", "parameters": {"type": "object"}}]
        return "/v1/responses", body, {}
    if fmt == "anthropic_messages":
        body = {
            "model": "m",
            "max_tokens": 64,
            "messages": [{"role": "user", "content": text}],
            "stream": stream,
        }
        if tools:
            body["tools"] = [{"name": "bash", "input_schema": {"type": "object"}}]
        return "/v1/messages", body, {"anthropic-version": "2023-06-01"}
    if fmt == "gemini":
        body = {"contents": [{"role": "user", "parts": [{"text": text}]}]}
        if tools:
            body["tools"] = [
                {"functionDeclarations": [{"name": "bash", "parametersJsonSchema": {"type": "object"}}]}
            ]
        path = (
            "/v1beta/models/m:streamGenerateContent?alt=sse" if stream else "/v1beta/models/m:generateContent"
        )
        return path, body, {}
    raise ValueError(fmt)


def error_message(fmt: str, body: Any) -> str:
    """The message of an error body, asserting it has the format's own shape."""
    if fmt == "anthropic_messages":
        assert body["type"] == "error" and isinstance(body["error"]["type"], str), body
        msg = body["error"]["message"]
    elif fmt == "gemini":
        assert isinstance(body["error"]["code"], int) and isinstance(body["error"]["status"], str), body
        msg = body["error"]["message"]
    else:
        assert isinstance(body["error"]["type"], str), body
        msg = body["error"]["message"]
    assert isinstance(msg, str) and msg.startswith("fineenvs proxy:"), msg
    return msg


def reply_text(fmt: str, body: Any) -> str:
    """The assistant text of a non-streamed reply."""
    if fmt == "openai_chat":
        return str(body["choices"][0]["message"]["content"])
    if fmt == "openai_responses":
        return "".join(
            c["text"] for item in body["output"] if item["type"] == "message" for c in item["content"]
        )
    if fmt == "anthropic_messages":
        return "".join(b["text"] for b in body["content"] if b["type"] == "text")
    return "".join(p.get("text", "") for p in body["candidates"][0]["content"]["parts"])
