"""The scripted expert: the CPU teacher of the mini-reproduction (a stand-in for Qwen3.8-27B).

The published SFT baseline collects rollouts of a large teacher through the real harnesses. On a
CPU machine no model solves tasks, so the teacher here is a policy that reads the task from the
conversation, as a large model would, and answers in the served model's own chat format. It runs
inside the embedded engine (``--policy expert``): the expert's text is *forced* token by token
through the normal decoding path, so the reply has real prompt token ids, sampled ids, processed
logprobs (the served model's, of the forced tokens) and tool calls parsed by the model's own
tool-call parser. Everything downstream (the proxy, the records, the rows, SFT) is unchanged.

What the expert knows:

- the mini task templates (``fineenvs.tasks.mini``): it recognises the question in a user message
  and writes one shell command that computes the answer from the data file into ``answer.txt``
  (``*.csv``: the task's one data file) — never the gold answer, which it does not see;
- which offered tool runs a shell command (``bash``, ``Bash``, ``exec_command``,
  ``run_shell_command``, ``terminal``, or any tool taking ``command``/``cmd``), and how each
  harness ends a task: Mini-SWE-Agent's submit command when the prompt asks for it, else a short
  final message.

The expert also has a habit, as real models do: on part of the tasks (decided by a hash of the
question, so collection is reproducible) it makes one tool call the task does not need. Its
students inherit the habit as a coin flip they cannot read off the task, which is what the
tool-call bonus of the reward can train away: on tasks a policy solves either way, one call earns
more than two (published: RL across harnesses cut tool calls on co-solved tasks by 31 %). Two
habits, one policy each (``engine.policy=``; the recipe's ``recipe.teacher_habit``):

- ``expert`` (**verify**, the recipe's default): after solving, on three tasks in four, it reads
  its answer back (``cat answer.txt``) before ending. The extra call comes after ``answer.txt`` is
  written, so it cannot change the grade: RL on correctness alone has no reason to keep or drop it,
  and only the bonus does — the control the bonus's effect needs. Three in four, not one in two:
  a student of the one-in-two teacher read back on too few of its solved tasks for pruning every
  read-back to reach the 20 % cut the recipe's target (5) asks of the bonus
  (experiments/mini_repro/README.md).
- ``expert_look`` (**look**, one task in two): it first looks at the data (``head -n 3 *.csv``),
  then solves. A 4-layer student that looked solved less often than one that did not (0.40 against
  0.53 at the start of RL in Pi), so RL on correctness alone pruned the look as well, and the bonus
  had little left to do (experiments/mini_repro/results/).

A conversation without a recognised task (an agent's title or summary call, say) gets a short
plain answer, so the agent moves on.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from fineenvs.engine.toolcalls import ToolCallFormat

SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
_SHELL_TOOLS = ("bash", "Bash", "exec_command", "run_shell_command", "terminal", "shell")
_COMMAND_KEYS = ("command", "cmd")
_QUESTIONS = (
    ("rows", re.compile(r"How many data rows does (\S+\.csv) have\?")),
    ("sum", re.compile(r"What is the sum of the (\w+) column \(column (\d+)\) in (\S+\.csv)\?")),
    ("max", re.compile(r"What is the largest value in the (\w+) column \(column (\d+)\) of (\S+\.csv)\?")),
)
LOOK_COMMAND = "head -n 3 *.csv"
VERIFY_COMMAND = "cat answer.txt"
DONE_TEXT = "The answer is in answer.txt."
NO_TASK_TEXT = "Solving the task."


def _texts(message: dict[str, Any]) -> list[str]:
    content = message.get("content")
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return []


def _question(messages: list[dict[str, Any]]) -> tuple[str, re.Match[str]] | None:
    for message in messages:
        if message.get("role") != "user":
            continue
        for text in _texts(message):
            for template, pattern in _QUESTIONS:
                match = pattern.search(text)
                if match is not None:
                    return template, match
    return None


VERIFY_SHARE = 0.75
LOOK_SHARE = 0.5
_HABIT_ORDER = (0, 2, 1, 3)
"""A question's place in this order (its hash's first byte mod 4) < 4 x share: the habit's tasks at
one in two (the first byte even, as before shares existed) are among its tasks at three in four."""


def has_habit(messages: list[dict[str, Any]], share: float) -> bool:
    """Whether the expert makes its habitual extra call on this conversation's task, a habit it has
    on ``share`` of the tasks (a multiple of 1/4)."""
    if share * 4 != round(share * 4) or not 0 <= share <= 1:
        raise ValueError(
            f"habit share {share}: a question's hash picks one of four quarters, so the habit's "
            "share is a multiple of 1/4. Fix: 0, 0.25, 0.5, 0.75 or 1"
        )
    found = _question(messages)
    if found is None:
        return False
    quarter = hashlib.sha256(found[1].group(0).encode()).digest()[0] % 4
    return _HABIT_ORDER.index(quarter) < round(4 * share)


def solution_command(messages: list[dict[str, Any]]) -> str | None:
    """The shell command that solves the task stated in the conversation's user messages."""
    found = _question(messages)
    if found is None:
        return None
    template, match = found
    if template == "rows":
        return "tail -n +2 *.csv | wc -l > answer.txt"
    n = match.group(2)
    if template == "sum":
        return f"awk -F, 'NR>1{{s+=${n}}}END{{print s}}' *.csv > answer.txt"
    # Not an awk variant of the sum command: the three commands differ from their first word, so
    # that which one a question needs is one early choice for the student.
    return f"cut -d, -f{n} *.csv | sort -n | tail -1 > answer.txt"


def shell_tool(tools: list[dict[str, Any]] | None) -> tuple[str, str, dict[str, Any]] | None:
    """(tool name, command argument, the tool's JSON schema) of the tool that runs shell commands."""
    functions = [t.get("function", t) for t in tools or [] if isinstance(t, dict)]
    by_name = {f.get("name"): f for f in functions if isinstance(f, dict)}
    ordered = [by_name[n] for n in _SHELL_TOOLS if n in by_name] + functions
    for f in ordered:
        props = (f.get("parameters") or {}).get("properties") or {}
        key = next((k for k in _COMMAND_KEYS if k in props), None)
        if key is not None:
            return str(f["name"]), key, f.get("parameters") or {}
    return None


def _ran(messages: list[dict[str, Any]], command: str) -> bool:
    for message in messages:
        for call in message.get("tool_calls") or []:
            args = (call.get("function") or {}).get("arguments")
            if isinstance(args, str) and command.split(" > ")[0] in args.replace('\\"', '"'):
                return True
    return False


def render_tool_call(fmt: ToolCallFormat, name: str, arguments: dict[str, Any]) -> str:
    """A tool call written as the model family writes it (what ``parse_tool_calls`` reads back)."""
    if fmt == "hermes":
        return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"
    if fmt == "qwen3_xml":
        params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in arguments.items())
        return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"
    rendered = ", ".join(f"{k}={v!r}" for k, v in arguments.items())
    return f"<|tool_call_start|>[{name}({rendered})]<|tool_call_end|>"


def expert_reply(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, fmt: ToolCallFormat
) -> str:
    """The expert's next assistant message, as text in the model's chat format; on the tasks of its
    habit (``VERIFY_SHARE`` of them) it reads its answer back before ending (``expert``)."""
    return _reply(messages, tools, fmt, look_first=False)


def expert_reply_look(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, fmt: ToolCallFormat
) -> str:
    """As ``expert_reply``, but the habit is looking at the data first, on ``LOOK_SHARE`` of the
    tasks (``expert_look``)."""
    return _reply(messages, tools, fmt, look_first=True)


def _reply(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    fmt: ToolCallFormat,
    *,
    look_first: bool,
) -> str:
    command = solution_command(messages)
    tool = shell_tool(tools)
    if command is None or tool is None:
        return NO_TASK_TEXT if command is None else DONE_TEXT
    name, key, _ = tool
    habit = has_habit(messages, LOOK_SHARE if look_first else VERIFY_SHARE)
    prompt_text = "\n".join(t for m in messages for t in _texts(m))
    if not _ran(messages, command):
        if look_first and habit and not _ran(messages, LOOK_COMMAND):
            return render_tool_call(fmt, name, {key: LOOK_COMMAND})
        return render_tool_call(fmt, name, {key: command})
    if not look_first and habit and not _ran(messages, VERIFY_COMMAND):
        return render_tool_call(fmt, name, {key: VERIFY_COMMAND})
    if SUBMIT in prompt_text and not _ran(messages, f"echo {SUBMIT}"):
        return render_tool_call(fmt, name, {key: f"echo {SUBMIT}"})
    return DONE_TEXT
