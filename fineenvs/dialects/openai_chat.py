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

from fineenvs.api_formats import ApiFormat
from fineenvs.dialects import canonical
from fineenvs.dialects._common import (
    RANGES,
    as_dict,
    canonical_request,
    fail,
    nonempty_list,
    optional_int,
    optional_number,
    require_dict,
    require_objects,
    require_str,
    type_name,
    unsupported,
)
from fineenvs.dialects.base import JSON, CanonicalRequest
from fineenvs.dialects.reply import DialectBase, Reply, read_completion, sse_data

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
ROLES = ("system", "developer", "user", "assistant", "tool")
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


def _content_parts(content: list[object], where: str) -> str | list[JSON]:
    parts: list[JSON] = []
    for _, part_where, p in require_objects(content, where):
        kind = p.get("type")
        if kind == "text":
            parts.append(canonical.text_part(require_str(p.get("text"), f"{part_where}.text")))
        elif kind == "image_url":
            image = p.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            parts.append(canonical.image_part(require_str(url, f"{part_where}.image_url.url")))
        else:
            raise unsupported(
                part_where,
                kind,
                "the engine takes text and image_url content parts only",
                "Send text (or image_url) parts.",
            )
    return canonical.text_or_parts(parts)


def _message(raw: object, i: int, notes: list[str]) -> JSON:
    where = f"messages[{i}]"
    msg = require_dict(raw, where)
    role = msg.get("role")
    if role not in ROLES:
        raise unsupported(
            where,
            role,
            f"chat roles are {', '.join(ROLES)}",
            "Use one of those roles (legacy role 'function' -> 'tool' with tool_call_id).",
            field="role",
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
                _tool_call(c, w) for _, w, c in require_objects(calls, f"{where}.tool_calls")
            ]
    if isinstance(msg.get("name"), str) and role in ("user", "assistant"):
        out["name"] = msg["name"]
    return out


def _tool_call(call: JSON, where: str) -> JSON:
    fn = require_dict(call.get("function"), f"{where}.function")
    args = canonical.arguments_json(fn.get("arguments"))
    return canonical.tool_call(
        require_str(call.get("id"), f"{where}.id"),
        require_str(fn.get("name"), f"{where}.function.name"),
        args,
    )


def _tools(raw: object, notes: list[str]) -> list[JSON]:
    tools: list[JSON] = []
    if raw is None:
        return tools
    for k, _, tool in require_objects(raw, "tools"):
        if tool.get("type", "function") != "function":
            notes.append(
                f"tools[{k}] of type {tool.get('type')!r} dropped: the engine runs function tools only"
            )
            continue
        fn = as_dict(tool.get("function")) or tool  # nested or flat shape
        name = require_str(fn.get("name"), f"tools[{k}].function.name")
        tools.append(canonical.function_tool(name, fn.get("description"), fn.get("parameters")))
        if "strict" in fn:
            tools[-1]["function"]["strict"] = fn["strict"]
    return tools


class OpenAIChat(DialectBase):
    name = ApiFormat.openai_chat.value
    error_names = ERROR_TYPES

    def convert(self, body: JSON, notes: list[str], path: str, query: dict[str, str]) -> CanonicalRequest:
        for legacy in ("functions", "function_call"):
            if legacy in body:
                raise fail(
                    f"{legacy} is not supported",
                    "it is the legacy function-calling API",
                    "Send tools/tool_choice instead.",
                    param=legacy,
                )
        raw_messages = nonempty_list(
            body.get("messages"),
            "messages",
            "a chat completion needs at least one message",
            "Send at least one user message.",
        )
        messages = canonical.normalise_messages(
            [_message(m, i, notes) for i, m in enumerate(raw_messages)], notes
        )
        out: JSON = {"messages": messages}
        for key in PASSTHROUGH:
            if body.get(key) is not None:
                if key in RANGES:  # the numbers: checked against their documented range
                    optional_number(body, key)
                out[key] = body[key]
        max_tokens = optional_int(body, "max_tokens")
        max_completion = optional_int(body, "max_completion_tokens")
        if max_tokens or max_completion:
            out["max_tokens"] = min(v for v in (max_tokens, max_completion) if v)
        canonical.finish_tools(out, _tools(body.get("tools"), notes), notes)
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        return canonical_request(out, body, notes, {"include_usage": include_usage})

    def from_chat_completion(self, completion: JSON, request: CanonicalRequest, *, model: str) -> JSON:
        reply = read_completion(completion)
        message: JSON = {
            "role": "assistant",
            "content": reply.content if reply.content or not reply.tool_calls else None,
        }
        if reply.reasoning:
            message["reasoning_content"] = reply.reasoning
        if reply.tool_calls:
            message["tool_calls"] = [canonical.tool_call(c.id, c.name, c.arguments) for c in reply.tool_calls]
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
        head: JSON = {
            "id": reply.id,
            "object": "chat.completion.chunk",
            "created": reply.created,
            "model": model,
        }

        def chunk(delta: JSON, finish: str | None = None) -> bytes:
            payload: JSON = {
                **head,
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
            opened = {"index": i, **canonical.tool_call(call.id, call.name, "")}
            yield chunk({"tool_calls": [opened]})
            if call.arguments:
                yield chunk({"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]})
        yield chunk({}, reply.finish_reason)
        if include_usage:
            yield sse_data({**head, "choices": [], "usage": _usage(reply)})
        yield b"data: [DONE]\n\n"

    def error_object(self, status: int, message: str, kind: str) -> JSON:
        return {"error": {"message": message, "type": kind, "param": None, "code": str(status)}}


def _usage(reply: Reply) -> JSON:
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
