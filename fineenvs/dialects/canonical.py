"""The pieces of the canonical request every format builds: message parts, tool calls and tools,
the system-message rule, the JSON output format.

What is covered: the shapes the engine's chat completions request takes (see ``base`` for the
conventions), built the same way by every format so that the same history always gives the same
canonical text. What is not covered: reading a format's own fields (its module, with the checks in
``_common``) and the reply side (``reply``).
"""

from __future__ import annotations

import json

from fineenvs.dialects.base import JSON


def json_schema_format(name: str, schema: object) -> JSON:
    """The chat ``response_format`` that asks for JSON matching ``schema``."""
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


def dumps_args(value: object) -> str:
    """Tool-call arguments as the JSON string chat completions carries (key order kept: prefix stability).

    None (a call sent without arguments) is the empty object.
    """
    return json.dumps(value if value is not None else {}, ensure_ascii=False)


def loads_args(arguments: str) -> JSON:
    """Tool-call arguments as an object for formats that carry objects; non-JSON is kept, not lost."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return {"raw_arguments": arguments}
    return value if isinstance(value, dict) else {"value": value}


def arguments_json(value: object) -> str:
    """Tool-call arguments sent as a string or an object, as the JSON string chat carries."""
    return value if isinstance(value, str) else dumps_args(value)


def tool_call(call_id: str, name: str, arguments: str) -> JSON:
    """One canonical (chat) tool call."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def join_text(parts: list[str]) -> str:
    # Text blocks of one message become one string (chat templates render strings best); the
    # separator is fixed so that the same history always gives the same canonical text.
    return "\n".join(parts)


def text_part(text: str) -> JSON:
    return {"type": "text", "text": text}


def image_part(url: str) -> JSON:
    return {"type": "image_url", "image_url": {"url": url}}


def text_or_parts(parts: list[JSON]) -> str | list[JSON]:
    """Text-only part lists become one string (as vLLM does); images keep the part list."""
    if all(p["type"] == "text" for p in parts):
        return join_text([p["text"] for p in parts])
    return parts


def normalise_messages(messages: list[JSON], notes: list[str]) -> list[JSON]:
    """Merge leading system/developer messages into one; later ones become user messages.

    Chat templates (Qwen, LFM) accept a system message only first; moving a mid-conversation
    system message to the top would rewrite the start of the prompt and break prefix linking, so
    it stays in place as a user turn.
    """
    out: list[JSON] = []
    leading: list[str] = []
    seen_other = False
    for msg in messages:
        role = msg.get("role")
        if role in ("system", "developer"):
            text = msg.get("content")
            text = (
                text
                if isinstance(text, str)
                else join_text(
                    [
                        p.get("text", "")
                        for p in text or []
                        if isinstance(p, dict) and isinstance(p.get("text"), str)
                    ]
                )
            )
            if not seen_other:
                leading.append(text)
                continue
            notes.append(
                f"mid-conversation {role} message sent as a user message at canonical position {len(out) + bool(leading)} "
                "(templates take system only first)"
            )
            out.append({"role": "user", "content": text})
            continue
        seen_other = True
        out.append(msg)
    if leading:
        if len(leading) > 1:
            notes.append(f"{len(leading)} leading system/developer messages merged into one system message")
        out.insert(0, {"role": "system", "content": "\n\n".join(leading)})
    return out


def function_tool(name: str, description: object, parameters: object) -> JSON:
    fn: JSON = {"name": name}
    if isinstance(description, str) and description:
        fn["description"] = description
    fn["parameters"] = parameters if isinstance(parameters, dict) else {"type": "object", "properties": {}}
    return {"type": "function", "function": fn}


def finish_tools(body: JSON, tools: list[JSON], notes: list[str]) -> None:
    """Set tools on a canonical body; with no tools, tool_choice/parallel_tool_calls go too.

    vLLM rejects tool_choice without tools (kimi-cli sends ``tools: []``; codex sends
    ``parallel_tool_calls`` without tools).
    """
    if tools:
        body["tools"] = tools
        return
    body.pop("tools", None)
    for key in ("tool_choice", "parallel_tool_calls"):
        if key in body:
            body.pop(key)
            notes.append(f"{key} dropped: the request has no tools the engine can call")
