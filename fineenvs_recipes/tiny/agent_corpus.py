"""Agent prompt text for tokenizer training: what real coding agents send their model.

A tokenizer learnt only from the generated corpus (``corpus.py``) stops merging at ~1.9 characters
per token: the corpus is small and repetitive, so a bigger vocabulary buys nothing, and a real
agent's first request is then far longer than for any real model (Claude Code 44k tokens, Codex
21k, OpenCode 13k; a real tokenizer gets 3.5-4.5 characters per token). A student that has to fit
every agent of a mix (``tiny_agent``) learns its vocabulary from this text as well.

``agent_prompts.json`` holds one request per agent, recorded from the real CLIs through the proxy
(``tests/fixtures/harness_records/<harness>.json``, the default format of each), converted to the
canonical chat request and flattened to text: every message's text and every tool's JSON schema.
The tasks in those recordings are the demo set's, never the mini set's, so no evaluation question,
file or answer is in it. Regenerate after re-recording the fixtures:

    python -m fineenvs_recipes.tiny.agent_corpus [RECORDS_DIR]

Measured (``tests/models/test_agent_corpus.py`` checks the leave-one-out form): with an 8k
vocabulary trained on this text plus the generated corpus, Claude Code's first request takes 3.9
characters per token; trained without Claude Code's own request, 3.6. The vocabulary learns
English, JSON schemas and shell, not one agent's prompt.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

AGENT_PROMPTS = Path(__file__).with_name("agent_prompts.json")


def _message_texts(message: dict[str, Any]) -> list[str]:
    content = message.get("content")
    texts: list[str] = []
    if isinstance(content, str):
        texts.append(content)
    elif isinstance(content, list):
        texts += [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        texts.append(json.dumps({"name": function.get("name"), "arguments": function.get("arguments")}))
    return texts


def request_text(body: dict[str, Any]) -> str:
    """A canonical chat request flattened to text: tool schemas, then every message's text."""
    parts = [json.dumps(tool, ensure_ascii=False) for tool in body.get("tools") or []]
    for message in body.get("messages") or []:
        parts += _message_texts(message)
    return "\n\n".join(parts)


def record_text(record: dict[str, Any]) -> str:
    """The text of one recorded agent request (``tests/fixtures/harness_records`` layout)."""
    from fineenvs.dialects import DIALECTS

    req = record["request"]
    path = req["path"]
    if path.startswith("/s/"):  # the session prefix in the agent's base URL
        path = "/" + path.split("/", 3)[3]
    path, _, query = path.partition("?")
    dialect = DIALECTS[record["api_format"]]
    canonical = dialect.to_canonical(copy.deepcopy(req["body"]), path=path, query=dict(parse_qsl(query)))
    return request_text(canonical.body)


def build_agent_prompts(records_dir: Path) -> list[dict[str, Any]]:
    """One entry per agent: the recording of its default format (``<harness>.json``)."""
    entries = []
    for path in sorted(Path(records_dir).glob("*.json")):
        if "." in path.stem:  # <harness>.<format>.json: another format of an agent already taken
            continue
        record = json.loads(path.read_text(encoding="utf-8"))
        text = record_text(record)
        entries.append({"harness": record["harness"], "version": record["version"], "text": text})
    if not entries:
        raise FileNotFoundError(f"no <harness>.json recordings under {records_dir}")
    return entries


def agent_prompt_texts(exclude: tuple[str, ...] = ()) -> list[str]:
    """The shipped agent texts (minus the agents in ``exclude``), in a fixed order."""
    entries = json.loads(AGENT_PROMPTS.read_text(encoding="utf-8"))
    return [e["text"] for e in entries if e["harness"] not in exclude]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    default = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "harness_records"
    records = Path(args[0]) if args else default
    entries = build_agent_prompts(records)
    AGENT_PROMPTS.write_text(json.dumps(entries, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")
    chars = sum(len(e["text"]) for e in entries)
    print(f"wrote {AGENT_PROMPTS}: {len(entries)} agents, {chars:,} characters")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
