"""Tool-call parsers for the embedded engine, one per model format (as vLLM's tool parsers).

Each parser takes the generated text and returns the visible content plus OpenAI-shaped
``tool_calls``. A malformed call is never an error: the whole text stays as content and no
tool call is returned (vLLM's hermes, qwen3_xml and lfm2 parsers behave the same way), so a
model's bad output reaches the agent as text instead of crashing the server.

- ``hermes``: ``<tool_call>\\n{"name": .., "arguments": {..}}\\n</tool_call>`` (Qwen2.5/Qwen3).
- ``qwen3_xml``: ``<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>\\n</function>\\n</tool_call>``
  (Qwen3.5, Qwen3-Coder); values are typed with the tool's JSON schema when it is known.
- ``lfm2``: ``<|tool_call_start|>[name(a='x', b=3), other()]<|tool_call_end|>`` (LFM2/LFM2.5).
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Literal

from fineenvs.jsonl import JsonObject

ToolCallFormat = Literal["hermes", "lfm2", "qwen3_xml"]
TOOL_CALL_FORMATS: tuple[ToolCallFormat, ...] = ("hermes", "lfm2", "qwen3_xml")


class MalformedToolCall(ValueError):
    """The text looks like a tool call but does not parse; the caller keeps it as content."""


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[JsonObject] = field(default_factory=list)


def _call(name: object, arguments: object) -> JsonObject:
    if not isinstance(name, str) or not name:
        raise MalformedToolCall(f"tool call name must be a non-empty string, got {name!r}")
    if not isinstance(arguments, dict):
        raise MalformedToolCall(f"tool call arguments must be an object, got {type(arguments).__name__}")
    return {
        "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


def _parse_hermes(text: str, tools: list[JsonObject] | None) -> list[JsonObject]:
    calls = []
    for match in _HERMES.finditer(text):
        body = (match.group(1) if match.group(1) is not None else match.group(2)).strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as exc:
            raise MalformedToolCall(f"tool call body is not JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise MalformedToolCall("tool call body is not a JSON object")
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models emit arguments as an encoded JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                raise MalformedToolCall("tool call arguments string is not JSON") from None
        calls.append(_call(obj.get("name"), args))
    return calls


_XML_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)
_XML_FUNCTION = re.compile(r"\A\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?\Z", re.DOTALL)
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


def _schema_types(tools: list[JsonObject] | None, name: str) -> JsonObject:
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        if isinstance(fn, dict) and fn.get("name") == name:
            params = fn.get("parameters") or {}
            props = params.get("properties") if isinstance(params, dict) else None
            return {k: (v or {}).get("type") for k, v in (props or {}).items() if isinstance(v, dict)}
    return {}


def _xml_value(raw: str, declared: object) -> object:
    # The template writes one newline either side of the value; strip exactly those.
    value = raw[1:] if raw.startswith("\n") else raw
    value = value[:-1] if value.endswith("\n") else value
    if declared == "string" or (isinstance(declared, list) and "string" in declared and len(declared) == 1):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value  # untyped or mistyped: keep the text (vLLM's qwen3_xml does the same)


def _parse_qwen3_xml(text: str, tools: list[JsonObject] | None) -> list[JsonObject]:
    calls = []
    for match in _XML_CALL.finditer(text):
        body = match.group(1) if match.group(1) is not None else match.group(2)
        fn = _XML_FUNCTION.match(body)
        if fn is None:
            raise MalformedToolCall("tool call has no <function=NAME> block")
        name = fn.group(1).strip()
        types = _schema_types(tools, name)
        args = {k.strip(): _xml_value(v, types.get(k.strip())) for k, v in _XML_PARAM.findall(fn.group(2))}
        calls.append(_call(name, args))
    return calls


_LFM2_BLOCK = re.compile(r"<\|tool_call_start\|>(.*?)(?:<\|tool_call_end\|>|\Z)", re.DOTALL)
# JSON literals that LFM2 writes inside mappings are not Python names.
_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.expr) -> object:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise MalformedToolCall("`**` unpacking is not a literal")
        return {
            _literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True) if k is not None
        }
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(e) for e in node.elts]
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise MalformedToolCall(f"argument {ast.unparse(node)!r} is not a literal") from None


def _parse_lfm2(text: str, tools: list[JsonObject] | None) -> list[JsonObject]:
    calls = []
    for block in _LFM2_BLOCK.findall(text):
        try:
            tree = ast.parse(block.strip(), mode="eval").body
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            raise MalformedToolCall("tool call block is not a Python list of calls") from None
        items = tree.elts if isinstance(tree, ast.List) else [tree]
        for item in items:
            if not isinstance(item, ast.Call) or not isinstance(item.func, ast.Name | ast.Attribute):
                raise MalformedToolCall("tool call block item is not a call")
            if item.args:
                raise MalformedToolCall("positional arguments in an LFM2 tool call")
            name = ast.unparse(item.func)
            args = {}
            for kw in item.keywords:
                if kw.arg is None:
                    raise MalformedToolCall("`**` unpacking in an LFM2 tool call")
                args[kw.arg] = _literal(kw.value)
            calls.append(_call(name, args))
    return calls


_START = {"hermes": "<tool_call>", "qwen3_xml": "<tool_call>", "lfm2": "<|tool_call_start|>"}
_PARSERS = {"hermes": _parse_hermes, "qwen3_xml": _parse_qwen3_xml, "lfm2": _parse_lfm2}


def parse_tool_calls(text: str, fmt: ToolCallFormat, tools: list[JsonObject] | None = None) -> ParsedOutput:
    """Split ``text`` into content and tool calls in format ``fmt``; malformed calls stay content."""
    if fmt not in _PARSERS:
        raise ValueError(f"unknown tool-call format {fmt!r}: choose one of {list(TOOL_CALL_FORMATS)}")
    start = text.find(_START[fmt])
    if start < 0:
        return ParsedOutput(content=text)
    try:
        calls = _PARSERS[fmt](text, tools)
    except (MalformedToolCall, RecursionError):
        return ParsedOutput(content=text)
    if not calls:
        return ParsedOutput(content=text)
    content = text[:start]
    if fmt == "lfm2":  # LFM2 may write text after the block; keep it visible
        content += _LFM2_BLOCK.sub("", text[start:])
    content = content.strip()
    return ParsedOutput(content=content or None, tool_calls=calls)
