"""OpenAI Responses (``POST /v1/responses``): codex (its only option), opencode, pi, hermes.

What is covered:
- ``instructions``, ``input`` as a string or a list of items: messages (roles user, assistant,
  system, developer; ``input_text`` / ``output_text`` / ``input_image`` / ``refusal`` parts; items
  with their own ``id``), ``function_call`` / ``function_call_output`` (string or part-list output),
  ``custom_tool_call`` / ``custom_tool_call_output``, ``reasoning`` items (our ``fe:``
  ``encrypted_content`` decoded, else ``content`` / ``summary`` text) attached to the next assistant
  turn; consecutive assistant message and call items merged into one assistant message;
  ``developer`` / ``system`` items merged into the system message (later ones kept as user turns);
- tools: ``function`` (with ``strict``), ``custom`` (freeform: one string argument ``input``),
  codex ``namespace`` (nested tools flattened to ``<namespace>__<name>``, mapped back to
  ``name`` + ``namespace`` in replies), ``web_search`` and other hosted tools dropped with a note;
  ``tool_choice``, ``parallel_tool_calls``, ``max_output_tokens`` -> ``max_tokens``,
  ``text.format`` json_schema -> ``response_format``; ``reasoning`` recorded in ``state``;
- replies: reasoning item (summary + ``encrypted_content`` that round-trips), message item,
  function/custom call items; status ``incomplete`` on length; usage with detail objects; the full
  event stream with ``sequence_number`` (``response.created`` ... ``response.completed``).

What is not covered: ``previous_response_id`` and ``item_reference`` (refused: the proxy stores no
responses; clients resend the full input), ``local_shell`` / ``shell`` / ``computer`` items
(refused), file inputs, ``n`` (Responses has none).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

from fineenvs.api_formats import ApiFormat
from fineenvs.dialects import canonical
from fineenvs.dialects._common import (
    as_dict,
    as_str,
    by_status,
    canonical_request,
    decode_reasoning,
    encode_reasoning,
    fail,
    optional_int,
    require_dict,
    require_list,
    require_objects,
    require_str,
    sampling_fields,
    stable_id,
    unsupported,
)
from fineenvs.dialects.base import JSON, CanonicalRequest
from fineenvs.dialects.reply import DialectBase, Usage, read_completion, typed_event

NS_SEP = "__"
ERROR_CODES = {
    400: "invalid_request_error",
    401: "invalid_api_key",
    404: "not_found",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
}


def _parts(content: object, where: str) -> str | list[JSON]:
    if isinstance(content, str):
        return content
    parts: list[JSON] = []
    for _, part_where, p in require_objects(content, where):
        kind = p.get("type")
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            parts.append(canonical.text_part(require_str(p.get("text"), f"{part_where}.text")))
        elif kind == "refusal":
            parts.append(canonical.text_part(require_str(p.get("refusal"), f"{part_where}.refusal")))
        elif kind == "input_image":
            url = p.get("image_url")
            if not isinstance(url, str):
                raise fail(
                    f"{part_where} input_image without image_url",
                    "the engine takes inline or URL images (file_id needs the OpenAI file store)",
                    "Send image_url as a data: or https: URL.",
                    param=f"{part_where}.image_url",
                )
            parts.append(canonical.image_part(url))
        else:
            raise unsupported(
                part_where,
                kind,
                "the proxy converts text and image parts",
                "Send input_text/output_text/input_image parts.",
            )
    return canonical.text_or_parts(parts)


def _reasoning_text(item: JSON) -> str:
    decoded = decode_reasoning(item.get("encrypted_content"))
    if decoded is not None:
        return decoded
    for key in ("content", "summary"):
        texts = [as_str(as_dict(p).get("text")) for p in item.get(key) or [] if isinstance(p, dict)]
        if any(texts):
            return canonical.join_text(texts)
    return ""


class _Builder:
    """Turns Responses input items into chat messages, merging one assistant turn's items."""

    def __init__(self, notes: list[str], names: dict[tuple[str, str], str]) -> None:
        self.notes = notes
        self.names = names  # (namespace, name) -> the name the engine sees
        self.messages: list[JSON] = []
        self.pending_reasoning: list[str] = []

    def assistant(self) -> JSON:
        """The open assistant message (created when the last message is not one)."""
        last = self.messages[-1] if self.messages else None
        if (
            last is None
            or last["role"] != "assistant"
            or self.pending_reasoning
            and "reasoning_content" in last
        ):
            last = {"role": "assistant", "content": None}
            self.messages.append(last)
        if self.pending_reasoning:
            last["reasoning_content"] = canonical.join_text(self.pending_reasoning)
            self.pending_reasoning = []
        return last

    def add(self, raw: object, i: int) -> None:
        where = f"input[{i}]"
        item = require_dict(raw, where)
        kind = item.get("type", "message")
        if kind == "message":
            self._message(item, where)
        elif kind in ("function_call", "custom_tool_call"):
            self._call(item, where)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            self._call_output(item, where)
        elif kind == "reasoning":
            text = _reasoning_text(item)
            if text:
                self.pending_reasoning.append(text)
        elif kind in ("web_search_call", "file_search_call", "image_generation_call", "mcp_list_tools"):
            self.notes.append(f"{where} {kind} item dropped: hosted tools do not run on the engine")
        else:
            raise unsupported(
                where,
                kind,
                "the proxy stores no responses and runs only function/custom tools",
                "Resend the full history as message, function_call, "
                "function_call_output and reasoning items.",
            )

    def _message(self, item: JSON, where: str) -> None:
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise unsupported(
                where,
                role,
                "message roles are user, assistant, system, developer",
                "Use one of those roles.",
                field="role",
            )
        content = _parts(item.get("content"), f"{where}.content")
        if role != "assistant":
            self.messages.append({"role": role, "content": content})
            return
        if isinstance(content, list):
            raise fail(
                f"{where} has an image in an assistant message",
                "the engine takes images from users only",
                "Move the image to a user item.",
                param=f"{where}.content",
            )
        msg = self.assistant()
        if msg.get("tool_calls") or msg["content"]:
            msg = {"role": "assistant", "content": None}  # a second text message is a new turn
            self.messages.append(msg)
        msg["content"] = content

    def _call(self, item: JSON, where: str) -> None:
        name = require_str(item.get("name"), f"{where}.name")
        ns = item.get("namespace")
        engine_name = (
            self.names.get((ns, name), f"{ns}{NS_SEP}{name}") if isinstance(ns, str) and ns else name
        )
        if item.get("type") == "function_call":
            args = require_str(item.get("arguments"), f"{where}.arguments")
        else:
            args = canonical.dumps_args({"input": require_str(item.get("input"), f"{where}.input")})
        msg = self.assistant()
        call_id = require_str(item.get("call_id"), f"{where}.call_id")
        msg.setdefault("tool_calls", []).append(canonical.tool_call(call_id, engine_name, args))

    def _call_output(self, item: JSON, where: str) -> None:
        output = item.get("output")
        text = _parts(output, f"{where}.output") if output is not None else ""
        images: list[JSON] = []
        if isinstance(text, list):
            images = [p for p in text if p["type"] != "text"]
            self.notes.append(f"{where}: images in a tool output moved to a following user message")
            text = canonical.join_text([p["text"] for p in text if p["type"] == "text"])
        call_id = require_str(item.get("call_id"), f"{where}.call_id")
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        if images:
            self.messages.append({"role": "user", "content": images})


def _tools(raw: object, notes: list[str], state: JSON) -> tuple[list[JSON], dict[tuple[str, str], str]]:
    tools: list[JSON] = []
    names: dict[tuple[str, str], str] = {}
    tool_map: dict[str, JSON] = {}

    def add(tool: JSON, where: str, namespace: str | None) -> None:
        kind = tool.get("type")
        if kind not in ("function", "custom"):
            notes.append(f"{where} {kind!r} tool dropped: hosted tools do not run on the engine")
            return
        name = require_str(tool.get("name"), f"{where}.name")
        engine_name = f"{namespace}{NS_SEP}{name}" if namespace else name
        if kind == "function":
            tools.append(
                canonical.function_tool(engine_name, tool.get("description"), tool.get("parameters"))
            )
            if isinstance(tool.get("strict"), bool):
                tools[-1]["function"]["strict"] = tool["strict"]
        else:
            # A freeform tool: the model writes raw text, carried as one string argument.
            description = as_str(tool.get("description"))
            schema = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
            tools.append(canonical.function_tool(engine_name, description, schema))
            notes.append(
                f"{where} custom (freeform) tool {name!r} offered as a function with one 'input' string"
            )
        if namespace or kind == "custom":
            tool_map[engine_name] = {"name": name, "namespace": namespace, "custom": kind == "custom"}
            if namespace:
                names[(namespace, name)] = engine_name

    for _, where, tool in require_objects(raw, "tools"):
        if tool.get("type") == "namespace":
            ns = require_str(tool.get("name"), f"{where}.name")
            for _, inner_where, inner in require_objects(tool.get("tools"), f"{where}.tools"):
                add(inner, inner_where, ns)
        else:
            add(tool, where, None)
    state["tool_map"] = tool_map
    return tools, names


def _tool_choice(raw: object, names: dict[tuple[str, str], str]) -> object:
    if isinstance(raw, str):
        return raw
    choice = require_dict(raw, "tool_choice")
    if choice.get("type") in ("function", "custom"):
        name = require_str(choice.get("name"), "tool_choice.name")
        ns = choice.get("namespace")
        if isinstance(ns, str):
            name = names.get((ns, name), name)
        return {"type": "function", "function": {"name": name}}
    return "auto"


# The request fields a Response object echoes back.
ECHOED = (
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "tool_choice",
    "parallel_tool_calls",
    "reasoning",
    "metadata",
    "store",
    "prompt_cache_key",
)
# Each output item streams opened with this field empty, then filled by its deltas.
STREAMED_FIELD = {"reasoning": "summary", "message": "content", "function_call": "arguments"}


def _messages(body: JSON, notes: list[str], names: dict[tuple[str, str], str]) -> list[JSON]:
    builder = _Builder(notes, names)
    instructions = body.get("instructions")
    if instructions is not None:
        builder.messages.append({"role": "system", "content": require_str(instructions, "instructions")})
    raw_input = body.get("input")
    if isinstance(raw_input, str):
        builder.messages.append({"role": "user", "content": raw_input})
    else:
        for i, item in enumerate(require_list(raw_input, "input")):
            builder.add(item, i)
    if builder.pending_reasoning:
        notes.append("trailing reasoning item without a following assistant item dropped")
    if not builder.messages:
        raise fail(
            "input is empty",
            "a model call needs at least one message",
            "Send a user message in input.",
            param="input",
        )
    return canonical.normalise_messages(builder.messages, notes)


class OpenAIResponses(DialectBase):
    name = ApiFormat.openai_responses.value

    def convert(self, body: JSON, notes: list[str], path: str, query: dict[str, str]) -> CanonicalRequest:
        if body.get("previous_response_id"):
            raise fail(
                "previous_response_id is not supported",
                "the capture proxy stores no responses",
                "Send store:false and the full history in input (codex and opencode do).",
                param="previous_response_id",
            )
        state: JSON = {}
        tools, names = _tools(body["tools"], notes, state) if body.get("tools") is not None else ([], {})
        out: JSON = {"messages": _messages(body, notes, names)}
        max_tokens = optional_int(body, "max_output_tokens")
        if max_tokens is not None:
            out["max_tokens"] = max_tokens
        out.update(sampling_fields(body, ("temperature", "top_p")))
        if body.get("tool_choice") is not None:
            out["tool_choice"] = _tool_choice(body["tool_choice"], names)
        if isinstance(body.get("parallel_tool_calls"), bool):
            out["parallel_tool_calls"] = body["parallel_tool_calls"]
        canonical.finish_tools(out, tools, notes)
        fmt = as_dict(as_dict(body.get("text")).get("format"))
        if fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
            out["response_format"] = canonical.json_schema_format(
                as_str(fmt.get("name"), "output"), fmt["schema"]
            )
        request = canonical_request(out, body, notes, state)
        state.update({key: body.get(key) for key in ECHOED if body.get(key) is not None})
        return request

    def _response(self, completion: JSON, request: CanonicalRequest, model: str) -> JSON:
        reply = read_completion(completion)
        output: list[JSON] = []
        if reply.reasoning:
            output.append(
                {
                    "id": stable_id("rs_", reply.id),
                    "type": "reasoning",
                    "status": "completed",
                    "summary": [{"type": "summary_text", "text": reply.reasoning}],
                    "encrypted_content": encode_reasoning(reply.reasoning),
                }
            )
        if reply.content or not reply.tool_calls:
            output.append(
                {
                    "id": stable_id("msg_", reply.id),
                    "type": "message",
                    "role": "assistant",
                    "status": "completed",
                    "content": [
                        {"type": "output_text", "text": reply.content, "annotations": [], "logprobs": []}
                    ],
                }
            )
        tool_map = as_dict(request.state.get("tool_map"))
        for k, call in enumerate(reply.tool_calls):
            mapped = as_dict(tool_map.get(call.name))
            item: JSON = {
                "id": stable_id("fc_", reply.id, k),
                "call_id": call.id,
                "name": as_str(mapped.get("name"), call.name),
                "status": "completed",
            }
            if mapped.get("namespace"):
                item["namespace"] = mapped["namespace"]
            if mapped.get("custom"):
                item.update({"type": "custom_tool_call", "input": _custom_input(call.arguments)})
            else:
                item.update({"type": "function_call", "arguments": call.arguments})
            output.append(item)
        incomplete = reply.finish_reason == "length"
        s = request.state
        reasoning = as_dict(s.get("reasoning"))
        return {
            "id": stable_id("resp_", reply.id),
            "object": "response",
            "created_at": reply.created,
            "model": model,
            "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "error": None,
            "output": output,
            "instructions": s.get("instructions"),
            "max_output_tokens": s.get("max_output_tokens"),
            "temperature": s.get("temperature", 1.0),
            "top_p": s.get("top_p", 1.0),
            "tool_choice": s.get("tool_choice", "auto"),
            "tools": [],
            "parallel_tool_calls": s.get("parallel_tool_calls", True),
            "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "store": bool(s.get("store", False)),
            "metadata": s.get("metadata") or {},
            "previous_response_id": None,
            "usage": _usage(reply.usage),
        }

    def from_chat_completion(self, completion: JSON, request: CanonicalRequest, *, model: str) -> JSON:
        return self._response(completion, request, model)

    def stream_events(self, completion: JSON, request: CanonicalRequest, *, model: str) -> Iterator[bytes]:
        final = self._response(completion, request, model)
        seq = 0

        def ev(kind: str, **fields: object) -> bytes:
            nonlocal seq
            seq += 1
            return typed_event(kind, sequence_number=seq - 1, **fields)

        pending = {**final, "status": "in_progress", "output": [], "incomplete_details": None, "usage": None}
        yield ev("response.created", response=pending)
        yield ev("response.in_progress", response=pending)
        for index, item in enumerate(final["output"]):
            yield from _item_events(ev, index, item)
        yield ev(
            "response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final
        )

    def error_object(self, status: int, message: str, kind: str) -> JSON:
        # The type is generic; the code names the status.
        code = by_status(ERROR_CODES, status, server="server_error", client=str(status))
        return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def _usage(u: Usage) -> JSON:
    return {
        "input_tokens": u.prompt,
        "input_tokens_details": {"cached_tokens": u.cached, "cache_write_tokens": 0},
        "output_tokens": u.completion,
        "output_tokens_details": {"reasoning_tokens": u.reasoning},
        "total_tokens": u.total,
    }


def _custom_input(arguments: str) -> str:
    """The freeform text of a custom tool call: the ``input`` argument, else the raw arguments."""
    value = canonical.loads_args(arguments).get("input")
    return value if isinstance(value, str) else arguments


Event = Callable[..., bytes]


def _item_events(ev: Event, index: int, item: JSON) -> Iterator[bytes]:
    """One output item streamed: added with its content empty, filled by its deltas, done."""
    kind = item["type"]
    emptied = STREAMED_FIELD.get(kind, "input")  # custom_tool_call: its input
    empty = "" if isinstance(item[emptied], str) else []
    yield ev(
        "response.output_item.added",
        output_index=index,
        item={**item, emptied: empty, "status": "in_progress"},
    )
    at = partial(ev, item_id=item["id"], output_index=index)
    if kind == "reasoning":
        yield from _reasoning_events(at, item["summary"][0]["text"])
    elif kind == "message":
        yield from _text_events(at, item["content"][0])
    elif kind == "function_call":
        yield at("response.function_call_arguments.delta", delta=item["arguments"])
        yield at("response.function_call_arguments.done", name=item["name"], arguments=item["arguments"])
    else:
        yield at("response.custom_tool_call_input.delta", delta=item["input"])
        yield at("response.custom_tool_call_input.done", input=item["input"])
    yield ev("response.output_item.done", output_index=index, item=item)


def _reasoning_events(at: Event, text: str) -> Iterator[bytes]:
    yield at(
        "response.reasoning_summary_part.added", summary_index=0, part={"type": "summary_text", "text": ""}
    )
    yield at("response.reasoning_summary_text.delta", summary_index=0, delta=text)
    yield at("response.reasoning_summary_text.done", summary_index=0, text=text)
    yield at(
        "response.reasoning_summary_part.done", summary_index=0, part={"type": "summary_text", "text": text}
    )


def _text_events(at: Event, part: JSON) -> Iterator[bytes]:
    text = part["text"]
    empty = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    yield at("response.content_part.added", content_index=0, part=empty)
    if text:
        yield at("response.output_text.delta", content_index=0, delta=text, logprobs=[])
    yield at("response.output_text.done", content_index=0, text=text, logprobs=[])
    yield at("response.content_part.done", content_index=0, part=part)


DIALECT = OpenAIResponses()
