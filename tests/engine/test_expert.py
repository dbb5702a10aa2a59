"""The scripted expert (the mini-reproduction's teacher): its replies parse as the model's own
tool calls, follow each harness's way of ending a task, and come out of the real server path."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from fineenvs.engine.server import create_engine_app
from fineenvs.engine.toolcalls import TOOL_CALL_FORMATS, parse_tool_calls
from fineenvs.plugins import PluginError
from fineenvs.tasks.mini import split_specs
from fineenvs_recipes.mini_repro.teacher import (
    DONE_TEXT,
    LOOK_COMMAND,
    LOOK_SHARE,
    SUBMIT,
    VERIFY_COMMAND,
    VERIFY_SHARE,
    expert_reply,
    expert_reply_look,
    has_habit,
    render_tool_call,
    solution_command,
)

QUESTION = (
    "What is the sum of the mass column (column 3) in kites.csv?\n\nData files in your working directory: "
    "kites.csv.\nWrite only the final answer (a single number) to answer.txt in your working directory.\n"
)
BASH = [{"type": "function", "function": {"name": "bash", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]  # fmt: skip
CODEX = [{"type": "function", "function": {"name": "exec_command", "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string"}, "workdir": {"type": "string"}},
    "required": ["cmd"]}}}]  # fmt: skip


@pytest.mark.parametrize("fmt", TOOL_CALL_FORMATS)
def test_rendered_calls_parse_back_in_every_format(fmt: Any) -> None:
    command = solution_command([{"role": "user", "content": QUESTION}])
    assert command == "awk -F, 'NR>1{s+=$3}END{print s}' *.csv > answer.txt"
    parsed = parse_tool_calls(render_tool_call(fmt, "bash", {"command": command}), fmt, BASH)
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["bash"]
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == {"command": command}


def test_the_three_templates_need_commands_that_differ_from_their_first_word() -> None:
    """The student's one decision per task comes first: rows, sum and max start with different
    programs, so no question's command is a prefix-sharing variant of another's."""
    questions = (
        "How many data rows does vans.csv have?",
        "What is the sum of the mass column (column 2) in vans.csv?",
        "What is the largest value in the mass column (column 2) of vans.csv?",
    )
    commands = [solution_command([{"role": "user", "content": q}]) for q in questions]
    assert all(c is not None and c.endswith(" > answer.txt") for c in commands), commands
    assert len({c.split()[0] for c in commands if c is not None}) == 3, commands
    assert "-f2 " in str(commands[2]) and "$2" in str(commands[1])


def _call(reply: str, tools: list[dict[str, Any]]) -> dict[str, Any]:
    parsed = parse_tool_calls(reply, "hermes", tools)
    assert len(parsed.tool_calls) == 1, reply
    call = parsed.tool_calls[0]
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def test_mini_swe_agent_flow_solves_then_submits_then_stops() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You can interact with a computer."},
        {"role": "user", "content": f"Please solve this issue: {QUESTION}\nFinish with `echo {SUBMIT}`."},
    ]
    first = _call(expert_reply(messages, BASH, "hermes"), BASH)
    assert "awk" in first["tool_calls"][0]["function"]["arguments"]
    messages += [first, {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "0"}]
    second = _call(expert_reply(messages, BASH, "hermes"), BASH)
    assert json.loads(second["tool_calls"][0]["function"]["arguments"]) == {"command": f"echo {SUBMIT}"}
    messages += [second, {"role": "tool", "tool_call_id": "x", "content": ""}]
    assert expert_reply(messages, BASH, "hermes") == DONE_TEXT


def test_other_harnesses_end_with_a_message_and_codex_gets_its_cmd_argument() -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}]
    first = _call(expert_reply(messages, CODEX, "hermes"), CODEX)
    assert first["tool_calls"][0]["function"]["name"] == "exec_command"
    assert "cmd" in json.loads(first["tool_calls"][0]["function"]["arguments"])
    messages += [first, {"role": "tool", "tool_call_id": "x", "content": "0"}]
    assert expert_reply(messages, CODEX, "hermes") == DONE_TEXT
    assert (
        expert_reply([{"role": "user", "content": "Write a title for this chat"}], BASH, "hermes")
        != DONE_TEXT
    )


HABITUAL = "What is the sum of the mass column (column 2) in kites.csv?"
DIRECT = "How many data rows does cars.csv have?"


def _commands(reply: Any, question: str, finish: str) -> list[Any]:
    """Run ``reply`` (a policy) on ``question`` to its end: the commands it called, then its last text."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": question + finish}]
    out: list[Any] = []
    for _ in range(5):
        text = reply(messages, BASH, "hermes")
        if "<tool_call>" not in text:
            return [*out, text]
        call = _call(text, BASH)
        out.append(json.loads(call["tool_calls"][0]["function"]["arguments"])["command"])
        messages += [call, {"role": "tool", "tool_call_id": "x", "content": "id,mass\n1,210\n2,250"}]
    raise AssertionError(f"no end after 5 replies: {out}")


def test_the_verify_habit_reads_the_answer_back_after_solving_on_three_tasks_in_four() -> None:
    """``expert``: the habit's extra call comes after answer.txt is written (it cannot change the
    grade); in Mini-SWE-Agent it comes before the submit command."""
    assert has_habit([{"role": "user", "content": HABITUAL}], VERIFY_SHARE)
    assert not has_habit([{"role": "user", "content": DIRECT}], VERIFY_SHARE)
    solve = solution_command([{"role": "user", "content": HABITUAL}])
    assert _commands(expert_reply, HABITUAL, "") == [solve, VERIFY_COMMAND, DONE_TEXT]
    submit = f"\nFinish with `echo {SUBMIT}`."
    assert _commands(expert_reply, HABITUAL, submit) == [solve, VERIFY_COMMAND, f"echo {SUBMIT}", DONE_TEXT]
    direct = solution_command([{"role": "user", "content": DIRECT}])
    assert _commands(expert_reply, DIRECT, "") == [direct, DONE_TEXT]
    # decided by the question alone (reproducible): three in four of every split for verify, one in
    # two for look, and the look's tasks among the verify's (the habit's tasks grow with its share)
    for split in ("train", "eval"):
        specs = split_specs(split)
        verify = [has_habit([{"role": "user", "content": s.question}], VERIFY_SHARE) for s in specs]
        look = [has_habit([{"role": "user", "content": s.question}], LOOK_SHARE) for s in specs]
        # (train: 0.64; a rows question names only its file, so few distinct ones decide that share)
        assert 0.6 <= sum(verify) / len(specs) <= 0.9, (split, sum(verify) / len(specs))
        assert 0.35 <= sum(look) / len(specs) <= 0.65, (split, sum(look) / len(specs))
        assert all(v for v, lk in zip(verify, look, strict=True) if lk) and sum(verify) > sum(look)
        # the look's tasks as before shares existed (the learning test's teacher): first byte even
        assert look == [hashlib.sha256(s.question.encode()).digest()[0] % 2 == 0 for s in specs]
    with pytest.raises(ValueError, match="quarters"):
        has_habit([{"role": "user", "content": HABITUAL}], 0.6)


def test_the_look_habit_looks_at_the_data_first_on_one_task_in_two() -> None:
    """``expert_look`` (the recipe's habit until 2026-12-07): look (head), then solve, then end."""
    assert has_habit([{"role": "user", "content": HABITUAL}], LOOK_SHARE)
    solve = solution_command([{"role": "user", "content": HABITUAL}])
    assert _commands(expert_reply_look, HABITUAL, "") == [LOOK_COMMAND, solve, DONE_TEXT]
    direct = solution_command([{"role": "user", "content": DIRECT}])
    assert _commands(expert_reply_look, DIRECT, "") == [direct, DONE_TEXT]


def test_expert_policy_serves_through_the_engine_path(tiny_qwen_dir: Path) -> None:
    """Forced through normal decoding: token ids decode to the reply, the model's parser finds the
    call, logprobs are the served model's (finite, <= 0), one per token."""
    app = create_engine_app(tiny_qwen_dir, served_model_name="teacher", policy="expert")
    with TestClient(app) as client:
        body = {
            "messages": [{"role": "user", "content": QUESTION}],
            "tools": BASH,
            "logprobs": True,
            "return_token_ids": True,
            "max_tokens": 200,
        }
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        choice = out["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        args = json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])
        assert args == {"command": solution_command(body["messages"])}
        ids = choice["token_ids"]
        lps = [e["logprob"] for e in choice["logprobs"]["content"]]
        assert len(lps) == len(ids) and all(math.isfinite(x) and x <= 0 for x in lps)
        assert out["prompt_token_ids"] and len(out["prompt_token_ids"]) == out["usage"]["prompt_tokens"]
    # The engine finds scripted policies by name (fineenvs/plugins.py), and says which exist.
    with pytest.raises(
        PluginError,
        match=r"no plugin 'oracle' in the entry-point group fineenvs.engine_policies: installed are \['expert', 'expert_look'\]",
    ):
        create_engine_app(tiny_qwen_dir, served_model_name="x", policy="oracle")
