"""Aider (``aider-chat``, PyPI): OpenAI Chat or Anthropic Messages through litellm, edits as text.

Aider has no tools: the model edits files by writing them out in a text edit format (here
``whole``: the file name, then its full content in a fenced block), and aider applies the edits.
So the wire carries no tool calls and the proxy counts none; the agent's own trace is the only
count of its actions. :meth:`Aider.parse_outputs` reads it from aider's chat history file (one
action per file aider reports as applied), and ``actions_in_text`` tells the sandbox not to hold
the proxy's zero against it.

One ``--message`` is one user turn: aider answers it, applies the edits, retries a malformed
edit at most three times (its reflection limit) and exits. There is no step limit to set.
"""

from __future__ import annotations

import re
from pathlib import Path

from fineenvs.harnesses.base import (
    ANTHROPIC_MESSAGES,
    OPENAI_CHAT,
    Harness,
    Launch,
    Outputs,
    read_text,
    strip_v1,
    with_v1,
    write_json,
)

CHAT_HISTORY = "aider.chat.history.md"
LLM_HISTORY = "aider.llm.history.txt"
METADATA = "aider.model.metadata.json"
EDIT_FORMAT = "whole"
# What aider writes to its chat history after applying an edit to a file.
APPLIED = re.compile(r"^> Applied edit to (.+)$", re.MULTILINE)


def _model_name(fmt: str, model: str) -> str:
    """litellm's name: the provider prefix picks the client (Chat or Messages)."""
    return f"{'openai' if fmt == OPENAI_CHAT else 'anthropic'}/{model}"


class Aider(Harness):
    name = "aider"
    package = "aider-chat"
    registry = "pypi"
    version = "0.86.2"
    binary = "aider"
    api_formats = (OPENAI_CHAT, ANTHROPIC_MESSAGES)
    default_format = OPENAI_CHAT
    actions_in_text = True

    def write_config(self, launch: Launch) -> None:
        fmt = self.check_format(launch.api_format)
        # Known metadata for the served model: without it aider fetches litellm's price list from
        # GitHub on every start (the one lookup left once its update check and analytics are off).
        write_json(
            launch.home / METADATA,
            {
                _model_name(fmt, launch.model): {
                    "max_input_tokens": 200000,
                    "max_output_tokens": 8192,
                    "input_cost_per_token": 0,
                    "output_cost_per_token": 0,
                    "litellm_provider": "openai" if fmt == OPENAI_CHAT else "anthropic",
                    "mode": "chat",
                }
            },
        )

    def command(self, launch: Launch) -> list[str]:
        fmt = self.check_format(launch.api_format)
        return [
            str(self.binary_path),
            "--model",
            _model_name(fmt, launch.model),
            "--weak-model",
            _model_name(fmt, launch.model),
            "--model-metadata-file",
            str(launch.home / METADATA),
            "--edit-format",
            EDIT_FORMAT,
            "--message",
            launch.task_prompt,
            "--yes-always",
            "--no-git",
            "--no-auto-commits",
            "--no-gitignore",
            "--no-check-update",
            "--analytics-disable",
            "--no-show-model-warnings",
            "--no-show-release-notes",
            "--no-pretty",
            "--no-fancy-input",
            "--map-tokens",
            "0",
            "--chat-history-file",
            str(launch.home / CHAT_HISTORY),
            "--llm-history-file",
            str(launch.home / LLM_HISTORY),
            "--input-history-file",
            str(launch.home / ".aider" / "input.history"),
        ]

    def env(self, launch: Launch) -> dict[str, str]:
        fmt = self.check_format(launch.api_format)
        env = self.base_env(launch.home)
        if fmt == OPENAI_CHAT:
            env.update({"OPENAI_API_KEY": launch.session_key, "OPENAI_API_BASE": with_v1(launch.base_url)})
        else:
            env.update(
                {"ANTHROPIC_API_KEY": launch.session_key, "ANTHROPIC_API_BASE": strip_v1(launch.base_url)}
            )
        env.update({"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False"})
        return env

    def parse_outputs(self, attempt_dir: Path) -> Outputs:
        path = attempt_dir / "home" / CHAT_HISTORY
        history = read_text(path)
        if not history:
            return Outputs(final_text=None, native_tool_calls=None, detail=f"no chat history at {path}")
        edits = APPLIED.findall(history)
        # The last assistant reply: aider writes the model's text unprefixed, its own notes as "> ".
        blocks = [b for b in history.split("\n#### ") if b.strip()]
        last = blocks[-1] if blocks else ""
        reply = "\n".join(line for line in last.splitlines()[1:] if not line.startswith(">")).strip()
        return Outputs(
            final_text=reply or None,
            native_tool_calls=len(edits),
            detail=f"{len(edits)} applied edit(s) in {CHAT_HISTORY}",
        )
