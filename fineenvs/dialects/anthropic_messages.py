"""Anthropic Messages (``POST /v1/messages``, also ``?beta=true``): claude-code, opencode, pi,
qwen-code, mini-swe-agent (litellm), hermes.

What is covered:
- ``system`` as a string or a list of text blocks (``cache_control`` ignored); Claude Code's
  per-request ``x-anthropic-billing-header: ...`` nonce (first system block or line) stripped with a
  note, because it changes every request and would break prefix linking; ``role: system`` messages
  inside ``messages`` (Claude Code's mid-conversation system) kept in place as user turns;
- content as a string or blocks: ``text``, ``image`` (base64 or url -> chat ``image_url``),
  ``tool_use`` -> ``tool_calls`` (input JSON-encoded, key order kept), ``tool_result`` -> ``role: tool``
  messages (string, text-block and image-block contents; ``is_error`` -> ``[Tool Error] `` prefix;
  images moved to a following user message), ``thinking`` -> ``reasoning_content``,
  ``redacted_thinking`` (ours decoded, others dropped with a note), server-tool blocks dropped;
- tools: client tools with ``input_schema`` (also litellm's ``type: custom``; ``cache_control`` and
  ``eager_input_streaming`` ignored); server tools (``web_search_*``, ``bash_*``, ... without
  ``input_schema``) dropped with a note; ``tool_choice`` auto/any(-> required)/tool/none and
  ``disable_parallel_tool_use``; ``tools: []`` drops ``tool_choice``;
- ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stop_sequences`` -> ``stop``;
  ``output_config.format`` json_schema -> ``response_format``; ``thinking`` recorded in ``state``;
- replies: ``thinking`` (synthetic ``fe:`` sha256 signature) before ``text`` before ``tool_use``;
  stop reasons mapped; usage with cache fields (no nulls); the full named-event stream
  (``message_start`` ... ``message_stop``, ``signature_delta`` before a thinking block closes).

What is not covered: ``document`` / ``search_result`` / ``container_upload`` blocks (refused),
real Anthropic signatures (not verifiable here; the thinking text is used as sent),
``context_management`` and ``metadata`` (dropped: nothing to do for a local engine).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from fineenvs.api_formats import ApiFormat
from fineenvs.dialects import canonical
from fineenvs.dialects._common import (
    INT64_MAX,
    Range,
    as_dict,
    as_str,
    canonical_request,
    decode_reasoning,
    fail,
    nonempty_list,
    optional_int,
    require_dict,
    require_objects,
    require_str,
    sampling_fields,
    stable_id,
    string_list,
    thinking_signature,
    type_name,
    unsupported,
)
from fineenvs.dialects.base import JSON, CanonicalRequest
from fineenvs.dialects.reply import DialectBase, Reply, read_completion, typed_event

BILLING_PREFIX = "x-anthropic-billing-header:"
STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "content_filter": "refusal",
}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
SERVER_BLOCKS = (
    "server_tool_use",
    "web_search_tool_result",
    "web_fetch_tool_result",
    "code_execution_tool_result",
    "bash_code_execution_tool_result",
    "text_editor_code_execution_tool_result",
    "mcp_tool_use",
    "mcp_tool_result",
    "container_upload",
    "tool_search_tool_result",
)

# Anthropic's documented ranges where they differ from the chat fields' (temperature is 0-1).
_ANTHROPIC_RANGES = {
    "temperature": Range(0, 1, False, "it scales randomness (Anthropic: 0 to 1)"),
    "top_k": Range(0, INT64_MAX, True, "it keeps the k most likely tokens"),
}


def _image(block: JSON, where: str) -> JSON:
    source = require_dict(block.get("source"), f"{where}.source")
    if source.get("type") == "base64":
        media = require_str(source.get("media_type"), f"{where}.source.media_type")
        data = require_str(source.get("data"), f"{where}.source.data")
        return canonical.image_part(f"data:{media};base64,{data}")
    if source.get("type") == "url":
        return canonical.image_part(require_str(source.get("url"), f"{where}.source.url"))
    raise unsupported(
        f"{where}.source",
        source.get("type"),
        "the engine takes inline or URL images",
        "Send the image as base64 or url source.",
    )


def _tool_result(block: JSON, where: str) -> tuple[JSON, list[JSON]]:
    """One ``role: tool`` message, plus image parts that must follow in a user message."""
    call_id = require_str(block.get("tool_use_id"), f"{where}.tool_use_id")
    content = block.get("content")
    texts: list[str] = []
    images: list[JSON] = []
    if isinstance(content, str):
        texts.append(content)
    elif isinstance(content, list):
        for _, part_where, part in require_objects(content, f"{where}.content"):
            if part.get("type") == "text":
                texts.append(require_str(part.get("text"), f"{part_where}.text"))
            elif part.get("type") == "image":
                images.append(_image(part, part_where))
            else:
                raise unsupported(
                    part_where,
                    part.get("type"),
                    "tool results carry text and images",
                    "Send text or image blocks.",
                )
    elif content is not None:
        raise fail(
            f"{where}.content must be a string or a list of blocks (got {type_name(content)})",
            "that is the tool_result shape",
            "Send the result as a string.",
            param=f"{where}.content",
        )
    text = canonical.join_text(texts)
    if block.get("is_error") is True:
        text = "[Tool Error] " + text
    return {"role": "tool", "tool_call_id": call_id, "content": text}, images


@dataclass
class _Turn:
    """What the blocks of one message hold, sorted by where they go in the canonical messages."""

    role: str
    where: str
    notes: list[str]
    tool_messages: list[JSON] = field(default_factory=list)  # tool results, before the user's text
    parts: list[JSON] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: list[JSON] = field(default_factory=list)
    follow_images: list[JSON] = field(default_factory=list)  # images from tool results

    def add(self, block: JSON, bw: str) -> None:
        kind, role = block.get("type"), self.role
        if kind == "text":
            self.parts.append(canonical.text_part(require_str(block.get("text"), f"{bw}.text")))
        elif kind == "image":
            self.parts.append(_image(block, bw))
        elif kind == "tool_use" and role == "assistant":
            call_id = require_str(block.get("id"), f"{bw}.id")
            name = require_str(block.get("name"), f"{bw}.name")
            self.calls.append(canonical.tool_call(call_id, name, canonical.dumps_args(block.get("input"))))
        elif kind == "tool_result" and role == "user":
            tool_msg, images = _tool_result(block, bw)
            self.tool_messages.append(tool_msg)
            self.follow_images.extend(images)
        elif kind == "thinking" and role == "assistant":
            self.reasoning.append(as_str(block.get("thinking")))
        elif kind == "redacted_thinking" and role == "assistant":
            text = decode_reasoning(block.get("data"))
            if text is None:
                self.notes.append(f"{bw} redacted_thinking from another provider dropped (unreadable)")
            else:
                self.reasoning.append(text)
        elif kind in SERVER_BLOCKS:
            self.notes.append(f"{bw} {kind} block dropped: server-side tools do not run on the engine")
        else:
            raise fail(
                f"{bw}.type={kind!r} is not supported in a {role} message",
                "the proxy converts text, image, tool_use, tool_result and thinking blocks",
                "Send those block types (documents as extracted text).",
                param=f"{bw}.type",
            )

    def user_messages(self) -> list[JSON]:
        out = self.tool_messages
        if self.follow_images:
            self.notes.append(f"{self.where}: images inside tool_result moved to a following user message")
            self.parts.extend(self.follow_images)
        if self.parts:
            out.append({"role": "user", "content": canonical.text_or_parts(self.parts)})
        elif not out:
            out.append({"role": "user", "content": ""})
        return out

    def assistant_message(self) -> JSON:
        parts, calls = self.parts, self.calls
        if any(p["type"] != "text" for p in parts):
            raise fail(
                f"{self.where} has an image in an assistant message",
                "the engine takes images from users only",
                "Move the image to a user message.",
                param=f"{self.where}.content",
            )
        assistant: JSON = {
            "role": "assistant",
            "content": canonical.join_text([p["text"] for p in parts]) if parts else None,
        }
        if not parts and not calls:
            assistant["content"] = ""
        if self.reasoning:
            assistant["reasoning_content"] = canonical.join_text(self.reasoning)
        if calls:
            assistant["tool_calls"] = calls
        return assistant


def _message(raw: object, i: int, notes: list[str]) -> list[JSON]:
    where = f"messages[{i}]"
    msg = require_dict(raw, where)
    role = msg.get("role")
    if role not in ("user", "assistant", "system"):
        raise unsupported(
            where,
            role,
            "Messages roles are user and assistant (and system mid-conversation)",
            "Use role user or assistant.",
            field="role",
        )
    content = msg.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    blocks = require_objects(content, f"{where}.content")
    if role == "system":
        return [
            {"role": "system", "content": canonical.join_text([as_str(b.get("text")) for _, _, b in blocks])}
        ]
    turn = _Turn(role, where, notes)
    for _, bw, block in blocks:
        turn.add(block, bw)
    return turn.user_messages() if role == "user" else [turn.assistant_message()]


def _system(raw: object, notes: list[str]) -> str | None:
    if raw is None:
        return None
    if isinstance(raw, str):
        texts = [raw]
    else:
        texts = [require_str(b.get("text"), f"{w}.text") for _, w, b in require_objects(raw, "system")]
    if texts and texts[0].startswith(BILLING_PREFIX):
        first, _, rest = texts[0].partition("\n")
        notes.append("claude-code billing header (per-request nonce) stripped from the system prompt")
        texts = ([rest] if rest.strip() else []) + texts[1:]
    return canonical.join_text(texts) if texts else None


def _tools(raw: object, notes: list[str]) -> list[JSON]:
    tools: list[JSON] = []
    if raw is None:
        return tools
    for k, _, tool in require_objects(raw, "tools"):
        if "input_schema" not in tool or tool.get("type") not in (None, "custom"):
            notes.append(
                f"tools[{k}] {tool.get('type') or tool.get('name')!r} dropped: a server-side tool "
                "the engine cannot run"
            )
            continue
        tools.append(
            canonical.function_tool(
                require_str(tool.get("name"), f"tools[{k}].name"),
                tool.get("description"),
                require_dict(tool.get("input_schema"), f"tools[{k}].input_schema"),
            )
        )
    return tools


def _tool_choice(raw: object) -> tuple[object, bool | None]:
    choice = require_dict(raw, "tool_choice")
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") is True else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool":
        name = require_str(choice.get("name"), "tool_choice.name")
        return {"type": "function", "function": {"name": name}}, parallel
    raise unsupported(
        "tool_choice", kind, "Anthropic tool_choice types are auto, any, tool, none", "Send one of those."
    )


def _messages(body: JSON, notes: list[str]) -> list[JSON]:
    raw_messages = nonempty_list(
        body.get("messages"), "messages", "a model call needs at least one message", "Send a user message."
    )
    messages: list[JSON] = []
    system = _system(body.get("system"), notes)
    if system is not None:
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(raw_messages):
        messages.extend(_message(m, i, notes))
    return canonical.normalise_messages(messages, notes)


class AnthropicMessages(DialectBase):
    name = ApiFormat.anthropic_messages.value
    error_names = ERROR_TYPES
    server_error_name = "api_error"

    def convert(self, body: JSON, notes: list[str], path: str, query: dict[str, str]) -> CanonicalRequest:
        out: JSON = {"messages": _messages(body, notes)}
        max_tokens = optional_int(body, "max_tokens")
        if max_tokens is not None:
            out["max_tokens"] = max_tokens
        out.update(sampling_fields(body, ("temperature", "top_p", "top_k"), _ANTHROPIC_RANGES))
        if body.get("stop_sequences") is not None:
            out["stop"] = string_list(body["stop_sequences"], "stop_sequences")
        if body.get("tool_choice") is not None:
            out["tool_choice"], parallel = _tool_choice(body["tool_choice"])
            if parallel is not None:
                out["parallel_tool_calls"] = parallel
        canonical.finish_tools(out, _tools(body.get("tools"), notes), notes)
        fmt = as_dict(as_dict(body.get("output_config")).get("format"))
        if fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
            out["response_format"] = canonical.json_schema_format("output", fmt["schema"])
        thinking = as_dict(body.get("thinking"))
        return canonical_request(out, body, notes, {"thinking": as_str(thinking.get("type"))})

    def _blocks(self, completion: JSON) -> tuple[Reply, list[JSON]]:
        reply = read_completion(completion)
        blocks: list[JSON] = []
        if reply.reasoning:
            blocks.append(
                {
                    "type": "thinking",
                    "thinking": reply.reasoning,
                    "signature": thinking_signature(reply.reasoning),
                }
            )
        if reply.content or not reply.tool_calls:
            blocks.append(canonical.text_part(reply.content))
        for call in reply.tool_calls:
            blocks.append(
                {
                    "type": "tool_use",
                    "id": call.id,
                    "name": call.name,
                    "input": canonical.loads_args(call.arguments),
                }
            )
        return reply, blocks

    def from_chat_completion(self, completion: JSON, request: CanonicalRequest, *, model: str) -> JSON:
        reply, blocks = self._blocks(completion)
        return _message_object(reply, model, blocks, STOP_REASONS.get(reply.finish_reason, "end_turn"))

    def stream_events(self, completion: JSON, request: CanonicalRequest, *, model: str) -> Iterator[bytes]:
        reply, blocks = self._blocks(completion)
        started = _message_object(reply, model, [], None)
        started["usage"] = {**started["usage"], "output_tokens": 1}
        yield typed_event("message_start", message=started)
        for index, block in enumerate(blocks):
            yield from _block_events(index, block)
        stop_reason = STOP_REASONS.get(reply.finish_reason, "end_turn")
        yield typed_event(
            "message_delta", delta={"stop_reason": stop_reason, "stop_sequence": None}, usage=_usage(reply)
        )
        yield typed_event("message_stop")

    def error_object(self, status: int, message: str, kind: str) -> JSON:
        return {"type": "error", "error": {"type": kind, "message": message}}


def _message_object(reply: Reply, model: str, content: list[JSON], stop_reason: str | None) -> JSON:
    return {
        "id": stable_id("msg_", reply.id),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": _usage(reply),
    }


def _block_events(index: int, block: JSON) -> Iterator[bytes]:
    """One content block streamed: opened empty, filled by its deltas, closed."""
    kind = block["type"]
    if kind == "thinking":
        empty: JSON = {"type": "thinking", "thinking": "", "signature": ""}
        deltas = [
            {"type": "thinking_delta", "thinking": block["thinking"]},
            {"type": "signature_delta", "signature": block["signature"]},
        ]
    elif kind == "text":
        empty = canonical.text_part("")
        deltas = [{"type": "text_delta", "text": block["text"]}] if block["text"] else []
    else:
        empty = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
        deltas = [{"type": "input_json_delta", "partial_json": canonical.dumps_args(block["input"])}]
    yield typed_event("content_block_start", index=index, content_block=empty)
    for delta in deltas:
        yield typed_event("content_block_delta", index=index, delta=delta)
    yield typed_event("content_block_stop", index=index)


def _usage(reply: Reply) -> JSON:
    u = reply.usage
    # Anthropic counts cache reads separately from input_tokens.
    return {
        "input_tokens": max(0, u.prompt - u.cached),
        "output_tokens": u.completion,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached,
        "server_tool_use": {"web_search_requests": 0, "web_fetch_requests": 0},
        "service_tier": "standard",
    }


DIALECT = AnthropicMessages()
