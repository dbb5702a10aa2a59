"""OpenAI Chat Completions (``POST /v1/chat/completions``): opencode, pi, qwen-code, mini-swe-agent,
hermes, aider.

What is covered:
- messages with string, null, text-part-list and image-part content; ``developer`` and leading
  ``system`` messages merged into one system message, later system messages kept in place as user
  turns; assistant ``tool_calls`` (arguments as string or object) and ``reasoning_content`` /
  ``reasoning`` history; tool messages whose content is a string, an array of text parts (qwen) or
  an object (mini-swe-agent, JSON-encoded);
- function tools (nested ``function`` or flat shape), ``tools: []`` with ``tool_choice`` /
  ``parallel_tool_calls`` dropped; ``max_completion_tokens`` -> ``max_tokens``; ``stream_options``
  removed from the canonical request (``include_usage`` kept in ``state`` for the stream);
- replies with the served model name, filled usage details, no engine-only fields (token ids),
  logprobs only when the agent asked for them; the full chunk stream ending in ``data: [DONE]``.

What is not covered: ``n > 1`` (refused), audio/file content parts (refused), the legacy
``functions``/``function_call`` fields and ``role: function`` (refused), non-function tool types
(dropped with a note), streaming logprobs (the finished stream carries none).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from fineenvs.dialects._common import (
    SSE_COMMENT_KEEPALIVE,
    as_dict,
    check_n,
    dumps_args,
    fail,
    finish_tools,
    function_tool,
    join_text,
    normalise_messages,
    optional_int,
    optional_number,
    prefixed,
    read_completion,
    require_dict,
    require_list,
    require_str,
    sse_data,
    stop_completion,
    type_name,
)
from fineenvs.dialects.base import JSON, CanonicalRequest

# Fields forwarded as the agent sent them (the proxy records them and applies its own policy).
PASSTHROUGH = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "logprobs",
    "top_logprobs",
    "response_format",
    "logit_bias",
    "tool_choice",
    "parallel_tool_calls",
    "reasoning_effort",
    "chat_template_kwargs",
)
NUMERIC = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "top_logprobs",
)
ROLES = ("system", "developer", "user", "assistant", "tool")
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


def _content_parts(content: list[Any], where: str) -> str | list[JSON]:
    """Text-only part lists become one string (as vLLM does); images keep the part list."""
    parts: list[JSON] = []
    for j, part in enumerate(content):
        p = require_dict(part, f"{where}[{j}]")
        kind = p.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": require_str(p.get("text"), f"{where}[{j}].text")})
        elif kind == "image_url":
            image = p.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            parts.append(
                {"type": "image_url", "image_url": {"url": require_str(url, f"{where}[{j}].image_url.url")}}
            )
        else:
            raise fail(
                f"{where}[{j}].type={kind!r} is not supported",
                "the engine takes text and image_url content parts only",
                "Send text (or image_url) parts.",
                param=f"{where}[{j}].type",
            )
    if all(p["type"] == "text" for p in parts):
        return join_text([p["text"] for p in parts])
    return parts


def _message(raw: object, i: int, notes: list[str]) -> JSON:
    where = f"messages[{i}]"
    msg = require_dict(raw, where)
    role = msg.get("role")
    if role not in ROLES:
        raise fail(
            f"{where}.role={role!r} is not supported",
            f"chat roles are {', '.join(ROLES)}",
            "Use one of those roles (legacy role 'function' -> 'tool' with tool_call_id).",
            param=f"{where}.role",
        )
    content = msg.get("content")
    out: JSON = {"role": role}
    if isinstance(content, list):
        out["content"] = _content_parts(content, f"{where}.content")
    elif isinstance(content, dict) and role == "tool":
        # mini-swe-agent sends the tool result as an object; templates need a string.
        out["content"] = json.dumps(content, ensure_ascii=False)
        notes.append(f"{where}.content object JSON-encoded to a string")
    elif content is None or isinstance(content, str):
        out["content"] = content if content is not None else ("" if role != "assistant" else None)
    else:
        raise fail(
            f"{where}.content must be a string, an array of parts or null (got {type_name(content)})",
            "chat messages carry text or content parts",
            "Send the content as a string.",
            param=f"{where}.content",
        )
    if role == "tool":
        out["tool_call_id"] = require_str(msg.get("tool_call_id"), f"{where}.tool_call_id")
        if isinstance(out["content"], list):
            raise fail(
                f"{where}.content has image parts in a tool message",
                "chat tool messages carry text only",
                "Send the image in a following user message.",
                param=f"{where}.content",
            )
    if role == "assistant":
        reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            out["reasoning_content"] = reasoning
        calls = msg.get("tool_calls")
        if calls:
            out["tool_calls"] = [
                _tool_call(c, f"{where}.tool_calls[{k}]")
                for k, c in enumerate(require_list(calls, f"{where}.tool_calls"))
            ]
    if isinstance(msg.get("name"), str) and role in ("user", "assistant"):
        out["name"] = msg["name"]
    return out


def _tool_call(raw: object, where: str) -> JSON:
    call = require_dict(raw, where)
    fn = require_dict(call.get("function"), f"{where}.function")
    args = fn.get("arguments")
    args = args if isinstance(args, str) else dumps_args(args if args is not None else {})
    return {
        "id": require_str(call.get("id"), f"{where}.id"),
        "type": "function",
        "function": {"name": require_str(fn.get("name"), f"{where}.function.name"), "arguments": args},
    }


def _tools(raw: object, notes: list[str]) -> list[JSON]:
    tools: list[JSON] = []
    for k, t in enumerate(require_list(raw, "tools")):
        tool = require_dict(t, f"tools[{k}]")
        if tool.get("type", "function") != "function":
            notes.append(
                f"tools[{k}] of type {tool.get('type')!r} dropped: the engine runs function tools only"
            )
            continue
        fn = as_dict(tool.get("function")) or tool  # nested or flat shape
        name = require_str(fn.get("name"), f"tools[{k}].function.name")
        tools.append(function_tool(name, fn.get("description"), fn.get("parameters")))
        if "strict" in fn:
            tools[-1]["function"]["strict"] = fn["strict"]
    return tools


class OpenAIChat:
    name = "openai_chat"

    def to_canonical(
        self, body: JSON, *, path: str = "", query: dict[str, str] | None = None
    ) -> CanonicalRequest:
        body = require_dict(body, "request body")
        notes: list[str] = []
        check_n(body.get("n"), "n")
        for legacy in ("functions", "function_call"):
            if legacy in body:
                raise fail(
                    f"{legacy} is not supported",
                    "it is the legacy function-calling API",
                    "Send tools/tool_choice instead.",
                    param=legacy,
                )
        raw_messages = require_list(body.get("messages"), "messages")
        if not raw_messages:
            raise fail(
                "messages is empty",
                "a chat completion needs at least one message",
                "Send at least one user message.",
                param="messages",
            )
        messages = normalise_messages([_message(m, i, notes) for i, m in enumerate(raw_messages)], notes)
        out: JSON = {"messages": messages}
        for key in PASSTHROUGH:
            if body.get(key) is not None:
                if key in NUMERIC:
                    optional_number(body, key)
                out[key] = body[key]
        max_tokens = optional_int(body, "max_tokens")
        max_completion = optional_int(body, "max_completion_tokens")
        if max_tokens or max_completion:
            out["max_tokens"] = min(v for v in (max_tokens, max_completion) if v)
        finish_tools(out, _tools(body["tools"], notes) if body.get("tools") is not None else [], notes)
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise fail(
                f"stream must be a boolean (got {type_name(stream)})",
                "it selects SSE or JSON",
                "Send stream: true or false.",
                param="stream",
            )
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        model = body.get("model")
        return CanonicalRequest(
            body=out,
            stream=bool(stream),
            model=model if isinstance(model, str) else None,
            notes=notes,
            state={"include_usage": include_usage},
        )

    def from_chat_completion(self, completion: JSON, request: CanonicalRequest, *, model: str) -> JSON:
        reply = read_completion(completion)
        message: JSON = {
            "role": "assistant",
            "content": reply.content if reply.content or not reply.tool_calls else None,
        }
        if reply.reasoning:
            message["reasoning_content"] = reply.reasoning
        if reply.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in reply.tool_calls
            ]
        logprobs = None
        if request.body.get("logprobs"):
            choice = completion["choices"][0]
            logprobs = choice.get("logprobs") if isinstance(choice, dict) else None
        return {
            "id": reply.id,
            "object": "chat.completion",
            "created": reply.created,
            "model": model,
            "choices": [
                {"index": 0, "message": message, "finish_reason": reply.finish_reason, "logprobs": logprobs}
            ],
            "usage": _usage(reply),
        }

    def stream_events(self, completion: JSON, request: CanonicalRequest, *, model: str) -> Iterator[bytes]:
        reply = read_completion(completion)
        include_usage = bool(request.state.get("include_usage"))

        def chunk(delta: JSON, finish: str | None = None) -> bytes:
            payload: JSON = {
                "id": reply.id,
                "object": "chat.completion.chunk",
                "created": reply.created,
                "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
            }
            if include_usage:
                payload["usage"] = None  # as OpenAI does: usage only on the last chunk
            return sse_data(payload)

        yield chunk({"role": "assistant", "content": ""})
        if reply.reasoning:
            yield chunk({"reasoning_content": reply.reasoning})
        if reply.content:
            yield chunk({"content": reply.content})
        for i, call in enumerate(reply.tool_calls):
            yield chunk(
                {
                    "tool_calls": [
                        {
                            "index": i,
                            "id": call.id,
                            "type": "function",
                            "function": {"name": call.name, "arguments": ""},
                        }
                    ]
                }
            )
            if call.arguments:
                yield chunk({"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]})
        yield chunk({}, reply.finish_reason)
        if include_usage:
            yield sse_data(
                {
                    "id": reply.id,
                    "object": "chat.completion.chunk",
                    "created": reply.created,
                    "model": model,
                    "choices": [],
                    "usage": _usage(reply),
                }
            )
        yield b"data: [DONE]\n\n"

    def error_body(self, status: int, message: str, *, kind: str | None = None) -> JSON:
        kind = kind or ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        return {"error": {"message": prefixed(message), "type": kind, "param": None, "code": str(status)}}

    def stop_reply(self, text: str, request: CanonicalRequest, *, model: str) -> JSON:
        return self.from_chat_completion(stop_completion(text), request, model=model)

    def keepalive(self) -> bytes:
        return SSE_COMMENT_KEEPALIVE


def _usage(reply: Any) -> JSON:
    u = reply.usage
    return {
        "prompt_tokens": u.prompt,
        "completion_tokens": u.completion,
        "total_tokens": u.total,
        "prompt_tokens_details": {"cached_tokens": u.cached, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": u.reasoning,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


DIALECT = OpenAIChat()
