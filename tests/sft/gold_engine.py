"""A teacher stand-in that solves demo tasks: the harness tests' scripted policy, writing the gold answer.

The scripted engine (``tests/harnesses/scripted_engine.py``) writes ``42`` to ``answer.txt``;
here the write command carries each task's gold answer instead, read from the task's hidden
answer **in this test fixture only** (fineenvs code never reads it; the grader does, outside the
sandbox). ``wrong_first`` tasks get a wrong answer on their first attempt and the gold one after,
``always_wrong`` tasks never get it: together they exercise "retry, keep the first correct attempt".
"""

from __future__ import annotations

import json
import threading
from typing import Any

from tests.harnesses.scripted_engine import (
    SHELL_COMMAND,
    TOOL_MARKER,
    ScriptedEngine,
    _text_of,
    scripted_logprob,
)

WRONG = "wrong-answer"


class GoldEngine(ScriptedEngine):
    def __init__(
        self,
        questions: dict[str, str],
        *,
        wrong_first: set[str] = frozenset(),  # type: ignore[assignment]
        always_wrong: set[str] = frozenset(),  # type: ignore[assignment]
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.questions = questions
        """question text -> gold answer."""
        self.wrong_first = set(wrong_first)
        self.always_wrong = set(always_wrong)
        self.writes: dict[str, list[str]] = {}
        """question -> answers written, in order (one per attempt that reached the write)."""
        self._lock = threading.Lock()

    def _question(self, body: dict[str, Any]) -> str:
        text = " ".join(_text_of(m.get("content")) for m in body.get("messages") or [] if isinstance(m, dict))
        found = [q for q in self.questions if q in text]
        if not found:
            raise AssertionError(f"no demo question in the request: {text[:300]!r}")
        return max(found, key=len)

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        reply = super().complete(body)
        choice = reply["choices"][0]
        message = choice["message"]
        calls = message.get("tool_calls") or []
        if not calls:
            return reply
        fn = calls[0]["function"]
        args = json.loads(fn["arguments"])
        key = next((k for k, v in args.items() if v == SHELL_COMMAND or v == [SHELL_COMMAND]), None)
        if key is None:
            return reply
        question = self._question(body)
        with self._lock:
            seen = self.writes.setdefault(question, [])
            wrong = question in self.always_wrong or (question in self.wrong_first and not seen)
            answer = WRONG if wrong else self.questions[question]
            seen.append(answer)
        command = f"printf '%s\\n' '{answer}' > answer.txt; echo {TOOL_MARKER}"
        args[key] = [command] if isinstance(args[key], list) else command
        fn["arguments"] = json.dumps(args)
        sampled = self.tokenizer.completion_ids(message)
        choice["token_ids"] = sampled
        choice["logprobs"] = {
            "content": [
                {"token": f"token_id:{t}", "logprob": scripted_logprob(t), "bytes": None, "top_logprobs": []}
                for t in sampled
            ]
        }
        usage = reply["usage"]
        usage["completion_tokens"] = len(sampled)
        usage["total_tokens"] = usage["prompt_tokens"] + len(sampled)
        return reply
