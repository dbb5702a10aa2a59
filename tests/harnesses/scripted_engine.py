"""A scripted policy behind the embedded engine's API, so real agent CLIs can finish a task.

A tiny random model cannot drive an agent. This stand-in answers ``POST /v1/chat/completions``
in the vLLM shape the proxy expects (``prompt_token_ids`` from a real tokenizer's chat template,
``choices[0].token_ids``, one ``token_id:<id>`` logprob entry <= 0 per sampled token,
``finish_reason``, parsed ``tool_calls``) and plays a fixed policy:

* no tool result yet and the request offers a shell tool: one call of that tool running
  ``SHELL_COMMAND`` (writes answer.txt, prints a marker the tests look for in the tool result);
* a tool result is present: a final text answer -- except for mini-swe-agent, whose every reply
  must call bash: there the next reply submits with ``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``;
* no tools but a text edit format in the system prompt (aider's ``*file listing*``): one reply that
  writes answer.txt as a whole-file listing;
* no tools otherwise (title generation and other side calls): short text, or JSON when a schema is asked.

Run: ``python tests/harnesses/scripted_engine.py --port N [--tokenizer-model tiny_qwen]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ANSWER = "42"
TOOL_MARKER = "FINEENVS_TOOL_RAN"
SHELL_COMMAND = f"echo {ANSWER} > answer.txt; echo {TOOL_MARKER}"
FINAL_TEXT = f"I wrote the answer {ANSWER} to answer.txt."
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
# Aider's whole-file edit format: the file name, then its full content in a fence.
FILE_LISTING_MARKER = "*file listing*"
FILE_LISTING_REPLY = f"I will write the answer.\n\nanswer.txt\n```\n{ANSWER}\n```\n"

# Shell tools of the harnesses, most specific first.
SHELL_TOOLS = (
    "Bash",
    "exec_command",
    "run_shell_command",
    "terminal",
    "execute_command",
    "bash",
    "shell",
    "execute_bash",
    "run_command",
    "run_commands",
    "Execute",
)
COMMAND_KEYS = ("command", "cmd", "commands", "code", "script", "input")


def _tool_name(tool: dict[str, Any]) -> str:
    fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
    return str(fn.get("name", ""))


def _tool_params(tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
    params = fn.get("parameters") or fn.get("input_schema") or {}
    return params if isinstance(params, dict) else {}


def pick_shell_tool(tools: list[dict[str, Any]]) -> dict[str, Any] | None:
    by_name = {_tool_name(t): t for t in tools if isinstance(t, dict)}
    for name in SHELL_TOOLS:
        if name in by_name:
            return by_name[name]
    return None


def _default_for(schema: dict[str, Any]) -> Any:
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    if "enum" in schema and schema["enum"]:
        return schema["enum"][0]
    return {"boolean": False, "integer": 30, "number": 30, "array": [], "object": {}}.get(str(kind), "")


def shell_arguments(tool: dict[str, Any], command: str) -> dict[str, Any]:
    """Arguments for the tool's schema: the command in its command-like field, required ones filled."""
    params = _tool_params(tool)
    props = params.get("properties") or {}
    key = next((k for k in COMMAND_KEYS if k in props), None) or "command"
    args: dict[str, Any] = {}
    schema = props.get(key) or {}
    args[key] = [command] if schema.get("type") == "array" else command
    for name in params.get("required") or []:
        if name in args:
            continue
        prop = props.get(name) or {}
        if name in ("description", "explanation", "reason"):
            args[name] = "write the answer file"
        elif name in ("requires_approval", "is_background", "run_in_background", "background"):
            args[name] = False
        else:
            args[name] = _default_for(prop)
    return args


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(_text_of(p.get("text") if isinstance(p, dict) else p) for p in content)
    return "" if content is None else str(content)


def decide(body: dict[str, Any]) -> dict[str, Any]:
    """The scripted assistant message for one chat-completions request."""
    messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
    tools = [t for t in body.get("tools") or [] if isinstance(t, dict)]
    shell = pick_shell_tool(tools)
    tool_result_seen = any(m.get("role") == "tool" for m in messages)
    mini = any("COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" in _text_of(m.get("content")) for m in messages[:2])
    if shell is not None and (not tool_result_seen or mini):
        command = SUBMIT if tool_result_seen else SHELL_COMMAND
        digest = hashlib.sha1(json.dumps(messages, sort_keys=True, default=str).encode()).hexdigest()[:16]
        return {
            "role": "assistant",
            "content": "Writing the answer." if not tool_result_seen else "Submitting.",
            "tool_calls": [
                {
                    "id": f"call_{digest}",
                    "type": "function",
                    "function": {
                        "name": _tool_name(shell),
                        "arguments": json.dumps(shell_arguments(shell, command)),
                    },
                }
            ],
        }
    if not tools and any(
        m.get("role") == "system" and FILE_LISTING_MARKER in _text_of(m.get("content")) for m in messages
    ):
        return {"role": "assistant", "content": FILE_LISTING_REPLY}
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") in ("json_schema", "json_object"):
        return {"role": "assistant", "content": json.dumps({"title": "Write answer", "isNewTopic": True})}
    if not tools:
        return {"role": "assistant", "content": "Write the answer"}
    return {"role": "assistant", "content": FINAL_TEXT}


def scripted_logprob(token_id: int) -> float:
    """The logprob the scripted policy reports for a sampled token (deterministic, < 0)."""
    return -0.01 * (1 + token_id % 9)


class Tokenizer:
    """The tiny model's tokenizer and chat template (real ids), with a plain-text fallback."""

    def __init__(self, model: str) -> None:
        from transformers import AutoTokenizer

        from fineenvs_recipes.tiny import ensure_tiny_model

        path: Path = ensure_tiny_model(model)
        self.tok = AutoTokenizer.from_pretrained(str(path))
        self.lock = threading.Lock()

    def _text(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, generation: bool
    ) -> str:
        # As the embedded engine (and vLLM) render: arguments decoded, the model's real template.
        from fineenvs.engine.server import _prepare_messages

        text = self.tok.apply_chat_template(
            _prepare_messages(messages), tools=tools or None, add_generation_prompt=generation, tokenize=False
        )
        return str(text)

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        with self.lock:
            try:
                text = self._text(messages, tools, True)
            except Exception:  # noqa: BLE001 - odd message shapes: tokenize the JSON instead
                text = json.dumps(messages, default=str)
            return [int(i) for i in self.tok.encode(text, add_special_tokens=False)]

    def completion_ids(
        self,
        message: dict[str, Any],
        messages: list[dict[str, Any]] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """What a model trained on this template samples for ``message``: the assistant turn as the
        template renders it, through the end-of-turn token. An agent that sends the turn back
        unchanged then gets a next prompt that extends prompt + sampled exactly (a chain)."""
        eos = self.tok.eos_token_id
        end = self.tok.decode([eos]) if eos is not None else None
        with self.lock:
            try:
                before = self._text(messages or [], tools, True)
                after = self._text([*(messages or []), {"role": "assistant", **message}], tools, False)
                if not after.startswith(before) or not end or end not in after[len(before) :]:
                    raise ValueError("template does not append the turn")
                turn = after[len(before) : after.index(end, len(before))]
                return [int(i) for i in self.tok.encode(turn, add_special_tokens=False)] + [int(eos)]
            except Exception:  # noqa: BLE001 - fall back to a plain rendering of the reply
                text = message.get("content") or ""
                for call in message.get("tool_calls") or []:
                    fn = call["function"]
                    args = json.loads(fn["arguments"])
                    text += (
                        f"\n<tool_call>\n{json.dumps({'name': fn['name'], 'arguments': args})}\n</tool_call>"
                    )
                ids = [int(i) for i in self.tok.encode(text, add_special_tokens=False)]
                return ids + ([int(eos)] if eos is not None else [])


class ScriptedEngine:
    """The HTTP server (a thread); ``requests`` keeps every request body it answered."""

    def __init__(
        self, *, port: int = 0, tokenizer_model: str = "tiny_qwen", served_model: str = "tiny_qwen"
    ) -> None:
        self.tokenizer = Tokenizer(tokenizer_model)
        self.served_model = served_model
        self.requests: list[dict[str, Any]] = []
        # (prompt ids, sampled ids) of every reply: the e2e tests check the proxy recorded exactly these.
        self.replies: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                if self.path.rstrip("/") in ("/health", ""):
                    self._send(200, {"status": "ok"})
                elif self.path.startswith("/v1/models"):
                    self._send(
                        200,
                        {
                            "object": "list",
                            "data": [{"id": engine.served_model, "object": "model", "max_model_len": 32768}],
                        },
                    )
                else:
                    self._send(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("content-length") or 0)
                try:
                    body = json.loads(self.rfile.read(length) or b"{}")
                except ValueError:
                    self._send(400, {"error": {"message": "body is not JSON"}})
                    return
                if not self.path.startswith("/v1/chat/completions"):
                    self._send(404, {"error": {"message": f"no route {self.path}"}})
                    return
                self._send(200, engine.complete(body))

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        self.requests.append(body)
        message = decide(body)
        prompt = self.tokenizer.prompt_ids(body.get("messages") or [], body.get("tools"))
        sampled = self.tokenizer.completion_ids(message, body.get("messages") or [], body.get("tools"))
        self.replies.add((tuple(prompt), tuple(sampled)))
        logprobs = [
            {"token": f"token_id:{t}", "logprob": scripted_logprob(t), "bytes": None, "top_logprobs": []}
            for t in sampled
        ]
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        return {
            "id": f"chatcmpl-{len(self.requests)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or self.served_model,
            "prompt_token_ids": prompt,
            "choices": [
                {
                    "index": 0,
                    "message": {"content": None, **message},
                    "finish_reason": finish,
                    "token_ids": sampled,
                    "logprobs": {"content": logprobs},
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(sampled),
                "total_tokens": len(prompt) + len(sampled),
            },
        }

    def start(self) -> ScriptedEngine:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--tokenizer-model", default="tiny_qwen")
    parser.add_argument("--served-model", default="tiny_qwen")
    args = parser.parse_args()
    engine = ScriptedEngine(
        port=args.port, tokenizer_model=args.tokenizer_model, served_model=args.served_model
    )
    print(f"scripted engine on {engine.url}", flush=True)
    engine.server.serve_forever()


if __name__ == "__main__":
    main()
