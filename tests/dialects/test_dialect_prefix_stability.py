"""Identical history converts to identical canonical messages on every turn.

The trajectory graph links calls by token prefix, so turn N+1's canonical messages must start with
exactly turn N's, followed by the engine's own reply as the engine produced it. Each test plays a
real client: it appends our reply to its history the way that harness does (thinking blocks with
signatures, Responses items with encrypted reasoning, Gemini parts with or without thoughts and
ids), adds the tool results, and converts again.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest

from fineenvs.dialects import DIALECTS
from fineenvs.dialects.base import CanonicalRequest

SERVED = "served-model"
SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}


def engine_turns(tool: str) -> list[dict[str, Any]]:
    """Three engine replies: a call with reasoning, a call without text, a final answer."""

    def done(turn: int, content: str | None, reasoning: str | None, call: bool) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": content, "reasoning": reasoning}
        if call:
            msg["tool_calls"] = [
                {
                    "id": f"chatcmpl-tool-{turn}",
                    "type": "function",
                    "function": {"name": tool, "arguments": json.dumps({"command": f"echo {turn}"})},
                }
            ]
        return {
            "id": f"chatcmpl-{turn}",
            "created": 1,
            "choices": [{"index": 0, "message": msg, "finish_reason": "tool_calls" if call else "stop"}],
            "usage": {"prompt_tokens": 10 * turn, "completion_tokens": 5},
        }

    return [
        done(1, "Let me check.", "Plan: run echo 1.\nThen look.", True),
        done(2, None, "Again.", True),
        done(3, "All done: it printed 2.", "", False),
    ]


def expected_assistant(completion: dict[str, Any], call_ids: list[str] | None = None) -> dict[str, Any]:
    msg = completion["choices"][0]["message"]
    out: dict[str, Any] = {"role": "assistant", "content": msg["content"]}
    if msg.get("reasoning"):
        out["reasoning_content"] = msg["reasoning"]
    if msg.get("tool_calls"):
        out["tool_calls"] = [
            {**c, "id": call_ids[i] if call_ids else c["id"]} for i, c in enumerate(msg["tool_calls"])
        ]
    return out


def play(
    api_format: str,
    first: dict[str, Any],
    append: Callable[[dict[str, Any], dict[str, Any], int], None],
    tool: str,
    *,
    path: str = "",
    query: dict[str, str] | None = None,
    ids: Callable[[int], list[str]] | None = None,
    mutate: Callable[[dict[str, Any], int], None] | None = None,
) -> list[CanonicalRequest]:
    dialect = DIALECTS[api_format]
    body = copy.deepcopy(first)
    seen: list[CanonicalRequest] = []
    for turn, completion in enumerate(engine_turns(tool), start=1):
        if mutate:
            mutate(body, turn)
        req = dialect.to_canonical(copy.deepcopy(body), path=path, query=query or {})
        if seen:
            prev = seen[-1].body["messages"]
            assert req.body["messages"][: len(prev)] == prev, f"turn {turn} rewrote the history prefix"
            assert req.body["messages"][len(prev)] == expected_assistant(
                engine_turns(tool)[turn - 2], ids(turn - 1) if ids else None
            )
        seen.append(req)
        append(body, dialect.from_chat_completion(completion, req, model=SERVED), turn)
    assert len(seen) == 3 and len(seen[-1].body["messages"]) > len(seen[0].body["messages"]) + 3
    return seen


def test_openai_chat_prefix_stable() -> None:
    def append(body: dict[str, Any], reply: dict[str, Any], turn: int) -> None:
        msg = {k: v for k, v in reply["choices"][0]["message"].items() if v is not None}
        body["messages"].append(msg)
        for call in msg.get("tool_calls", []):
            body["messages"].append(
                {
                    "role": "tool",
                    "tool_call_id": call["id"],
                    "content": [{"type": "text", "text": f"out {turn}"}],
                }
            )

    play(
        "openai_chat",
        {
            "model": "m",
            "stream": True,
            "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "go"}],
            "tools": [{"type": "function", "function": {"name": "bash", "parameters": SCHEMA}}],
        },
        append,
        "bash",
    )


@pytest.mark.parametrize("nonce_changes", [True, False])
def test_anthropic_prefix_stable_with_billing_nonce(nonce_changes: bool) -> None:
    def mutate(body: dict[str, Any], turn: int) -> None:
        # Claude Code's nonce differs on every request; stripping it keeps the prefix.
        nonce = turn if nonce_changes else 0
        body["system"][0]["text"] = f"x-anthropic-billing-header: cc_version=2.1.197; cch={nonce:05x};"

    def append(body: dict[str, Any], reply: dict[str, Any], turn: int) -> None:
        body["messages"].append({"role": "assistant", "content": reply["content"]})
        results = [
            {
                "type": "tool_result",
                "tool_use_id": b["id"],
                "content": f"out {turn}",
                "is_error": False,
                "cache_control": {"type": "ephemeral"},
            }
            for b in reply["content"]
            if b["type"] == "tool_use"
        ]
        if results:
            body["messages"].append({"role": "user", "content": results})
        if turn == 1:
            body["messages"].append(
                {"role": "system", "content": "<system-reminder>todo list empty</system-reminder>"}
            )

    seen = play(
        "anthropic_messages",
        {
            "model": "claude-opus-4-8",
            "max_tokens": 32000,
            "stream": True,
            "thinking": {"type": "adaptive"},
            "system": [{"type": "text", "text": ""}, {"type": "text", "text": "You are Claude Code."}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "go"}]}],
            "tools": [{"name": "Bash", "input_schema": SCHEMA}],
        },
        append,
        "Bash",
        mutate=mutate,
    )
    assert seen[0].body["messages"][0] == {"role": "system", "content": "You are Claude Code."}


def test_responses_prefix_stable_codex_items_and_namespace() -> None:
    def append(body: dict[str, Any], reply: dict[str, Any], turn: int) -> None:
        body["input"].extend(
            reply["output"]
        )  # codex resends every item, ids and encrypted reasoning included
        for item in reply["output"]:
            if item["type"] == "function_call":
                body["input"].append(
                    {"type": "function_call_output", "call_id": item["call_id"], "output": f"out {turn}"}
                )

    seen = play(
        "openai_responses",
        {
            "model": "m",
            "stream": True,
            "store": False,
            "include": ["reasoning.encrypted_content"],
            "input": [
                {
                    "type": "message",
                    "role": "developer",
                    "content": [{"type": "input_text", "text": "codex"}],
                },
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go"}]},
            ],
            "tools": [
                {
                    "type": "namespace",
                    "name": "multi_agent_v1",
                    "description": "d",
                    "tools": [{"type": "function", "name": "spawn_agent", "parameters": SCHEMA}],
                },
                {"type": "web_search"},
            ],
        },
        append,
        "multi_agent_v1__spawn_agent",
    )
    calls = [m for m in seen[-1].body["messages"] if m.get("tool_calls")]
    assert [c["tool_calls"][0]["function"]["name"] for c in calls] == ["multi_agent_v1__spawn_agent"] * 2


@pytest.mark.parametrize(
    ("keep_thoughts", "keep_ids", "include_thoughts"),
    [(True, True, True), (False, True, True), (True, False, True), (False, False, True), (True, True, False)],
)
def test_gemini_prefix_stable(keep_thoughts: bool, keep_ids: bool, include_thoughts: bool) -> None:
    def append(body: dict[str, Any], reply: dict[str, Any], turn: int) -> None:
        parts = [
            p for p in reply["candidates"][0]["content"]["parts"] if keep_thoughts or not p.get("thought")
        ]
        if not keep_ids:
            parts = [
                {**p, "functionCall": {k: v for k, v in p["functionCall"].items() if k != "id"}}
                if "functionCall" in p
                else p
                for p in parts
            ]
        body["contents"].append({"role": "model", "parts": parts})
        responses = [
            {
                "functionResponse": {
                    **({"id": p["functionCall"]["id"]} if keep_ids else {}),
                    "name": p["functionCall"]["name"],
                    "response": {"output": f"out {turn}"},
                }
            }
            for p in parts
            if "functionCall" in p
        ]
        if responses:
            body["contents"].append({"role": "user", "parts": responses})

    def ids(turn: int) -> list[str]:
        # The reply to a request with N contents sits at index N: turn 1 had 1 content, turn 2 had 3.
        return [f"call_{2 * turn - 1}_0"]

    play(
        "gemini",
        {
            "contents": [{"role": "user", "parts": [{"text": "go"}]}],
            "systemInstruction": {"parts": [{"text": "gemini"}]},
            "generationConfig": {"thinkingConfig": {"includeThoughts": include_thoughts}},
            "tools": [
                {"functionDeclarations": [{"name": "run_shell_command", "parametersJsonSchema": SCHEMA}]}
            ],
        },
        append,
        "run_shell_command",
        path="/v1beta/models/g:streamGenerateContent",
        query={"alt": "sse"},
        ids=ids,
    )
