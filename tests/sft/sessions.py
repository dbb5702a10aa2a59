"""Hand-made teacher sessions in the proxy store's record shape (``CallStore.read_session`` calls).

A conversation of two agent turns (a shell tool call, then a final answer), a retry the agent
abandoned before the first turn, a title-generator side call without tools, and a turn the output
cap cut. ``prompt_ids``/``sampled_ids`` are the teacher's tokens (here a tiny tokenizer's, so the
trajectory graph can link the calls); the SFT builder must not reuse them.
"""

from __future__ import annotations

import json
from typing import Any

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    }
]
SYSTEM = {"role": "system", "content": "You are a data analyst."}
USER = {"role": "user", "content": "What is the highest age in employees.csv?"}
TURN1 = {
    "role": "assistant",
    "content": "Let me look.",
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "bash", "arguments": json.dumps({"command": "sort -n ages | tail -1"})},
        }
    ],
}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "64"}
TURN2 = {"role": "assistant", "content": "The highest age is 64."}
ABANDONED = {"role": "assistant", "content": "Hmm"}
TITLE = {"role": "assistant", "content": "Highest age"}
CUT = {"role": "assistant", "content": "I will now explain at great length"}

# The student's rendering of each supervised turn (what its mask must decode to), per tiny model's
# template: the reply as the template writes it in a conversation, through the end-of-turn token.
EXPECTED = {
    "tiny_qwen": {
        "c1": 'Let me look.\n<tool_call>\n{"name": "bash", "arguments": {"command": "sort -n ages | tail -1"}}\n'
        "</tool_call><|im_end|>",
        "c2": "The highest age is 64.<|im_end|>",
        "c3": "Highest age<|im_end|>",
    },
    "tiny_lfm2": {
        "c1": "Let me look.<|tool_call_start|>[bash(command='sort -n ages | tail -1')]<|tool_call_end|><|im_end|>",
        "c2": "The highest age is 64.<|im_end|>",
        "c3": "Highest age<|im_end|>",
    },
    "tiny_qwen3_5": {
        "c1": "Let me look.\n\n<tool_call>\n<function=bash>\n<parameter=command>\nsort -n ages | tail -1\n"
        "</parameter>\n</function>\n</tool_call><|im_end|>",
        "c2": "The highest age is 64.<|im_end|>",
        "c3": "Highest age<|im_end|>",
    },
}


def _ids(tok: Any, messages: list[dict[str, Any]], tools: Any) -> list[int]:
    from fineenvs.engine.server import _prepare_messages

    text = tok.apply_chat_template(
        _prepare_messages(messages), tools=tools, tokenize=False, add_generation_prompt=True
    )
    return [int(i) for i in tok.encode(text, add_special_tokens=False)]


def _sampled(tok: Any, text: str) -> list[int]:
    return [int(i) for i in tok.encode(text, add_special_tokens=False)] + [int(tok.eos_token_id)]


def _call(
    index: int,
    call_id: str,
    messages: list[dict[str, Any]],
    tools: Any,
    response: dict[str, Any],
    tok: Any,
    *,
    finish: str = "stop",
) -> dict[str, Any]:
    prompt = _ids(tok, messages, tools)
    # The teacher's own continuation: whatever the next prompt extends (the graph links on it).
    return {
        "call_id": call_id,
        "index": index,
        "prompt_ids": prompt,
        "sampled_ids": _sampled(tok, str(response.get("content") or "")),
        "logprobs": None,
        "finish_reason": finish,
        "has_tools": bool(tools),
        "request": {"messages": messages, "tools": tools},
        "response": response,
    }


def agent_session_calls(tok: Any) -> list[dict[str, Any]]:
    """Arrival order: abandoned retry, turn 1, turn 2, title side call, a turn the output cap cut."""
    first = [SYSTEM, USER]
    second = [SYSTEM, USER, TURN1, TOOL_RESULT]
    calls = [
        _call(0, "c0", first, TOOLS, ABANDONED, tok),
        _call(1, "c1", first, TOOLS, TURN1, tok, finish="tool_calls"),
        _call(2, "c2", second, TOOLS, TURN2, tok),
        _call(3, "c3", [{"role": "user", "content": "Title for: " + str(USER["content"])}], None, TITLE, tok),
        _call(
            4,
            "c4",
            [SYSTEM, {"role": "user", "content": "Explain the data."}],
            TOOLS,
            CUT,
            tok,
            finish="length",
        ),
    ]
    # Turn 1's recorded end must be a prefix of turn 2's prompt for the graph to see that turn 1
    # continued (and so that c0, its sibling with the same prompt, was abandoned).
    calls[1]["sampled_ids"] = calls[2]["prompt_ids"][len(calls[1]["prompt_ids"]) :]
    return calls
