from __future__ import annotations

import json

import pytest

from fineenvs.engine.toolcalls import parse_tool_calls

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "zip": {"type": "string"},
                },
            },
        },
    }
]


def _calls(text: str, fmt: str) -> list[tuple[str, dict]]:
    parsed = parse_tool_calls(text, fmt, TOOLS)  # type: ignore[arg-type]
    for call in parsed.tool_calls:
        assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
        assert isinstance(call["function"]["arguments"], str)  # OpenAI: arguments are a JSON string
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls]


def test_hermes_single_and_multiple_calls() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    parsed = parse_tool_calls(text, "hermes")
    assert parsed.content == "Let me check."
    assert _calls(text, "hermes") == [("get_weather", {"city": "Paris", "days": 3})]
    two = text + '\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
    assert _calls(two, "hermes") == [
        ("get_weather", {"city": "Paris", "days": 3}),
        ("bash", {"command": "ls"}),
    ]


def test_hermes_without_content_and_unterminated() -> None:
    parsed = parse_tool_calls('<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}', "hermes")
    assert parsed.content is None
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == {"command": "ls"}


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>\n["get_weather"]\n</tool_call>',
        '<tool_call>\n{"arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "x", "arguments": [1]}\n</tool_call>',
        "<tool_call>",
    ],
)
def test_hermes_malformed_stays_content(text: str) -> None:
    parsed = parse_tool_calls(text, "hermes")
    assert parsed.tool_calls == [] and parsed.content == text


def test_qwen3_xml_typed_by_schema() -> None:
    text = (
        "I will look.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=zip>\n01234\n</parameter>\n</function>\n</tool_call>"
    )
    parsed = parse_tool_calls(text, "qwen3_xml", TOOLS)
    assert parsed.content == "I will look."
    # `zip` is declared a string: kept verbatim (not parsed as the number 1234)
    assert _calls(text, "qwen3_xml") == [("get_weather", {"city": "New York", "days": 3, "zip": "01234"})]


def test_qwen3_xml_multiline_value_and_two_calls() -> None:
    text = (
        "<tool_call>\n<function=write_file>\n<parameter=content>\nline 1\nline 2\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=bash>\n<parameter=command>\nls -la\n</parameter>\n</function>\n</tool_call>"
    )
    assert _calls(text, "qwen3_xml") == [
        ("write_file", {"content": "line 1\nline 2"}),
        ("bash", {"command": "ls -la"}),
    ]


@pytest.mark.parametrize(
    "text", ["<tool_call>\nno function here\n</tool_call>", "<tool_call>\n<function>\n</tool_call>"]
)
def test_qwen3_xml_malformed_stays_content(text: str) -> None:
    parsed = parse_tool_calls(text, "qwen3_xml")
    assert parsed.tool_calls == [] and parsed.content == text


def test_lfm2_pythonic_calls() -> None:
    text = "<|tool_call_start|>[get_weather(city='Paris', days=3), ping()]<|tool_call_end|>"
    assert _calls(text, "lfm2") == [("get_weather", {"city": "Paris", "days": 3}), ("ping", {})]
    assert parse_tool_calls(text, "lfm2").content is None


def test_lfm2_json_mappings_and_literals() -> None:
    text = 'Sure. <|tool_call_start|>[run(cfg={"a": true, "b": null, "c": [1, 2]}, flag=False, path="x y")]<|tool_call_end|> done'
    parsed = parse_tool_calls(text, "lfm2")
    assert parsed.content == "Sure.  done"
    assert _calls(text, "lfm2") == [
        ("run", {"cfg": {"a": True, "b": None, "c": [1, 2]}, "flag": False, "path": "x y"})
    ]


@pytest.mark.parametrize(
    "text",
    [
        "<|tool_call_start|>[get_weather(city=]<|tool_call_end|>",
        "<|tool_call_start|>[get_weather('Paris')]<|tool_call_end|>",
        "<|tool_call_start|>[1 + 2]<|tool_call_end|>",
        "<|tool_call_start|>[f(x=open('/etc/passwd'))]<|tool_call_end|>",
        "<|tool_call_start|>[f(**kw)]<|tool_call_end|>",
    ],
)
def test_lfm2_malformed_stays_content(text: str) -> None:
    parsed = parse_tool_calls(text, "lfm2")
    assert parsed.tool_calls == [] and parsed.content == text


def test_plain_text_is_content_in_every_format() -> None:
    for fmt in ("hermes", "lfm2", "qwen3_xml"):
        parsed = parse_tool_calls("just text", fmt)  # type: ignore[arg-type]
        assert parsed.content == "just text" and parsed.tool_calls == []


def test_unknown_format_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="hermes"):
        parse_tool_calls("x", "pythonic")  # type: ignore[arg-type]
