"""The official SDKs parse every reply and every stream the dialect modules produce.

Each client talks to an ``httpx.MockTransport`` that converts its request to the canonical form
and answers a canned engine completion in the client's own format (the proxy's conversion path,
without the proxy). The proxy's own tests run the same clients against the real app.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import httpx2
import openai
import pytest
from dialect_helpers import ENGINE_REASONING, ENGINE_TEXT, SERVED, TOOL_ARGS, FakeProxy
from google import genai
from google.genai import types as gtypes

SHELL_SCHEMA = {
    "type": "object",
    "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
    "required": ["command"],
}


@pytest.fixture
def proxy() -> FakeProxy:
    return FakeProxy()


def _openai(proxy: FakeProxy) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://proxy.test/s/key/v1",
        api_key="sk-x",
        http_client=httpx.Client(transport=httpx.MockTransport(proxy)),
    )


CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "bash", "description": "Run a command", "parameters": SHELL_SCHEMA},
    }
]


def test_openai_chat_with_tools(proxy: FakeProxy) -> None:
    resp = _openai(proxy).chat.completions.create(
        model="mangled/leaf", messages=[{"role": "user", "content": "run echo hi"}], tools=CHAT_TOOLS
    )  # type: ignore[list-item]
    assert proxy.formats == ["openai_chat"]
    assert resp.model == SERVED
    msg = resp.choices[0].message
    assert msg.content == ENGINE_TEXT
    assert msg.tool_calls and msg.tool_calls[0].function.name == "bash"  # type: ignore[union-attr]
    assert json.loads(msg.tool_calls[0].function.arguments) == TOOL_ARGS  # type: ignore[union-attr]
    assert resp.choices[0].finish_reason == "tool_calls"
    assert resp.usage and resp.usage.total_tokens == 150 and resp.usage.prompt_tokens_details
    assert resp.usage.prompt_tokens_details.cached_tokens == 100
    assert resp.usage.completion_tokens_details and resp.usage.completion_tokens_details.reasoning_tokens == 0
    dumped = resp.model_dump()
    assert "prompt_token_ids" not in dumped and "token_ids" not in dumped["choices"][0]
    assert dumped["choices"][0]["logprobs"] is None  # not asked for


def test_openai_chat_stream_helper_and_raw_chunks(proxy: FakeProxy) -> None:
    client = _openai(proxy)
    with client.chat.completions.stream(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        tools=CHAT_TOOLS,  # type: ignore[list-item]
        stream_options={"include_usage": True},
    ) as stream:
        final = stream.get_final_completion()
    msg = final.choices[0].message
    assert msg.content == ENGINE_TEXT and final.model == SERVED
    assert msg.tool_calls and msg.tool_calls[0].function.name == "bash"
    assert json.loads(msg.tool_calls[0].function.arguments) == TOOL_ARGS
    assert final.usage and final.usage.prompt_tokens == 120
    chunks = list(
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ENGINE_TEXT
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert all(c.usage is None for c in chunks)  # include_usage not asked for this time


RESPONSES_TOOLS = [
    {
        "type": "function",
        "name": "exec_command",
        "description": "Run",
        "parameters": SHELL_SCHEMA,
        "strict": False,
    },
    {"type": "web_search"},
]


def test_openai_responses_with_tools(proxy: FakeProxy) -> None:
    resp = _openai(proxy).responses.create(
        model="gpt-x",
        input=[{"role": "developer", "content": "You are codex."}, {"role": "user", "content": "hi"}],
        tools=RESPONSES_TOOLS,
        reasoning={"summary": "auto"},
        include=["reasoning.encrypted_content"],
        store=False,
    )  # type: ignore[list-item]
    assert proxy.formats == ["openai_responses"]
    assert resp.model == SERVED and resp.status == "completed"
    assert resp.output_text == ENGINE_TEXT
    kinds = [item.type for item in resp.output]
    assert kinds == ["reasoning", "message", "function_call"]
    call = resp.output[2]
    assert call.type == "function_call" and call.name == "exec_command"
    assert json.loads(call.arguments) == TOOL_ARGS
    assert resp.output[0].type == "reasoning" and resp.output[0].summary[0].text == ENGINE_REASONING
    assert resp.output[0].encrypted_content and resp.output[0].encrypted_content.startswith("fe:")
    assert resp.usage and resp.usage.input_tokens_details.cached_tokens == 100
    assert resp.usage.output_tokens_details.reasoning_tokens == 0 and resp.usage.total_tokens == 150


def test_openai_responses_stream_helper(proxy: FakeProxy) -> None:
    client = _openai(proxy)
    with client.responses.stream(model="m", input="hi", tools=RESPONSES_TOOLS) as stream:  # type: ignore[arg-type]
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == ENGINE_TEXT
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types_seen = [e.type for e in events]
    assert (
        types_seen[:2] == ["response.created", "response.in_progress"]
        and types_seen[-1] == "response.completed"
    )
    for needed in (
        "response.output_text.delta",
        "response.content_part.added",
        "response.content_part.done",
        "response.function_call_arguments.done",
        "response.reasoning_summary_text.delta",
    ):
        assert needed in types_seen
    text_stream = list(client.responses.create(model="m", input="hi", stream=True))
    deltas = [e.delta for e in text_stream if e.type == "response.output_text.delta"]
    assert "".join(deltas) == ENGINE_TEXT


def _anthropic(proxy: FakeProxy) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url="http://proxy.test/s/key",
        api_key="sk-x",
        http_client=httpx2.Client(transport=httpx2.MockTransport(proxy)),
    )


ANTHROPIC_TOOLS = [
    {"name": "Bash", "description": "Run", "input_schema": SHELL_SCHEMA},
    {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
]


def test_anthropic_with_tools_and_thinking(proxy: FakeProxy) -> None:
    msg = _anthropic(proxy).messages.create(
        model="claude-opus-4-8",
        max_tokens=1024,
        system=[{"type": "text", "text": "You are Claude Code."}],
        messages=[{"role": "user", "content": "run echo hi"}],
        tools=ANTHROPIC_TOOLS,  # type: ignore[list-item]
        thinking={"type": "enabled", "budget_tokens": 512},
    )
    assert proxy.formats == ["anthropic_messages"]
    assert any("web_search" in n for n in proxy.requests[0].notes)
    assert msg.model == SERVED and msg.stop_reason == "tool_use"
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"]
    thinking, text, tool = msg.content
    assert (
        thinking.type == "thinking"
        and thinking.thinking == ENGINE_REASONING
        and thinking.signature.startswith("fe:")
    )
    assert text.type == "text" and text.text == ENGINE_TEXT
    assert tool.type == "tool_use" and tool.name == "Bash" and tool.input == TOOL_ARGS
    assert (
        msg.usage.input_tokens == 20
        and msg.usage.cache_read_input_tokens == 100
        and msg.usage.output_tokens == 30
    )


def test_anthropic_stream_helper(proxy: FakeProxy) -> None:
    client = _anthropic(proxy)
    with client.messages.stream(
        model="m", max_tokens=64, messages=[{"role": "user", "content": "hi"}], tools=ANTHROPIC_TOOLS
    ) as stream:  # type: ignore[arg-type]
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].type == "thinking" and final.content[0].signature.startswith("fe:")
    assert final.content[2].type == "tool_use" and final.content[2].input == TOOL_ARGS
    assert final.stop_reason == "tool_use" and final.usage.output_tokens == 30
    with client.messages.stream(
        model="m", max_tokens=64, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        assert "".join(stream.text_stream) == ENGINE_TEXT


def _genai(proxy: FakeProxy) -> genai.Client:
    return genai.Client(
        api_key="g-x",
        http_options=gtypes.HttpOptions(
            base_url="http://proxy.test/s/key",
            httpx_client=httpx.Client(transport=httpx.MockTransport(proxy)),
        ),
    )


GEMINI_CONFIG = gtypes.GenerateContentConfig(
    system_instruction="You are gemini-cli.",
    tools=[
        gtypes.Tool(
            function_declarations=[
                gtypes.FunctionDeclaration(
                    name="run_shell_command", description="Run", parameters_json_schema=SHELL_SCHEMA
                )
            ]
        )
    ],
    thinking_config=gtypes.ThinkingConfig(include_thoughts=True),
    automatic_function_calling=gtypes.AutomaticFunctionCallingConfig(disable=True),
)


def test_gemini_generate_content_function_call(proxy: FakeProxy) -> None:
    resp = _genai(proxy).models.generate_content(
        model="gemini-3.1-pro", contents="run echo hi", config=GEMINI_CONFIG
    )
    assert proxy.formats == ["gemini"] and proxy.requests[0].model == "gemini-3.1-pro"
    assert not proxy.requests[0].stream
    assert resp.function_calls and resp.function_calls[0].name == "run_shell_command"
    assert resp.function_calls[0].args == TOOL_ARGS
    parts = resp.candidates[0].content.parts  # type: ignore[index,union-attr]
    assert parts and parts[0].thought is True and parts[0].text == ENGINE_REASONING
    assert parts[1].text == ENGINE_TEXT and parts[2].thought_signature  # bytes, decoded by the SDK
    assert resp.usage_metadata and resp.usage_metadata.total_token_count == 150
    assert resp.usage_metadata.prompt_token_count == 120 and resp.model_version == SERVED


def test_gemini_stream(proxy: FakeProxy) -> None:
    chunks = list(
        _genai(proxy).models.generate_content_stream(model="gemini-x", contents="hi", config=GEMINI_CONFIG)
    )
    assert proxy.requests[0].stream
    parts = [p for c in chunks for p in c.candidates[0].content.parts]  # type: ignore[index,union-attr]
    assert [p.text for p in parts if p.text and not p.thought] == [ENGINE_TEXT]
    calls = [p.function_call for p in parts if p.function_call]
    assert calls and calls[0].name == "run_shell_command" and calls[0].args == TOOL_ARGS
    assert chunks[-1].candidates[0].finish_reason == gtypes.FinishReason.STOP  # type: ignore[index]
    assert chunks[-1].usage_metadata and chunks[-1].usage_metadata.candidates_token_count == 30


def test_gemini_text_only_stream(proxy: FakeProxy) -> None:
    config = gtypes.GenerateContentConfig(max_output_tokens=50)
    chunks = list(
        _genai(proxy).models.generate_content_stream(model="gemini-x", contents="hi", config=config)
    )
    assert "".join(c.text or "" for c in chunks) == ENGINE_TEXT
    assert proxy.requests[0].body["max_tokens"] == 50


def test_errors_parse_as_sdk_errors(proxy: FakeProxy) -> None:
    with pytest.raises(openai.BadRequestError, match="fineenvs proxy: n=2"):
        _openai(proxy).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], n=2)
    with pytest.raises(anthropic.BadRequestError, match="fineenvs proxy: messages"):
        _anthropic(proxy).messages.create(model="m", max_tokens=5, messages=[])
    with pytest.raises(genai.errors.ClientError, match="candidateCount"):
        _genai(proxy).models.generate_content(
            model="g", contents="x", config=gtypes.GenerateContentConfig(candidate_count=2)
        )
