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

from fineenvs.api_formats import ApiFormat
from fineenvs.harnesses.base import (
    LITELLM_OFFLINE,
    LITELLM_PROVIDER,
    Launch,
    Outputs,
    PypiHarness,
    litellm_model,
    sdk_env,
)
from fineenvs.harnesses.files import read_text
from fineenvs.jsonl import JsonObject

CHAT_HISTORY = "aider.chat.history.md"
LLM_HISTORY = "aider.llm.history.txt"
METADATA = "aider.model.metadata.json"
EDIT_FORMAT = "whole"
# What aider writes to its chat history after applying an edit to a file.
APPLIED = re.compile(r"^> Applied edit to (.+)$", re.MULTILINE)
# litellm's names for the endpoint variables.
LITELLM_URL_ENV: dict[str, str] = {
    ApiFormat.openai_chat: "OPENAI_API_BASE",
    ApiFormat.anthropic_messages: "ANTHROPIC_API_BASE",
}
# Unattended without git (yes to every question, no commits), offline, plain output, no repo map.
UNATTENDED_FLAGS = ("--yes-always", "--no-git", "--no-auto-commits", "--no-gitignore")
OFFLINE_FLAGS = ("--no-check-update", "--analytics-disable")
PLAIN_FLAGS = ("--no-show-model-warnings", "--no-show-release-notes", "--no-pretty", "--no-fancy-input")
HEADLESS_FLAGS = (*UNATTENDED_FLAGS, *OFFLINE_FLAGS, *PLAIN_FLAGS, "--map-tokens", "0")
HISTORY_FLAGS = {
    "--chat-history-file": CHAT_HISTORY,
    "--llm-history-file": LLM_HISTORY,
    "--input-history-file": ".aider/input.history",
}


class Aider(PypiHarness):
    name = "aider"
    actions_in_text = True

    def config_files(self, launch: Launch, fmt: str) -> dict[str, JsonObject]:
        # Known metadata for the served model: without it aider fetches litellm's price list from
        # GitHub on every start (the one lookup left once its update check and analytics are off).
        metadata = {
            "max_input_tokens": 200000,
            "max_output_tokens": 8192,
            "input_cost_per_token": 0,
            "output_cost_per_token": 0,
            "litellm_provider": LITELLM_PROVIDER[fmt],
            "mode": "chat",
        }
        return {METADATA: {litellm_model(fmt, launch.model): metadata}}

    def arguments(self, launch: Launch) -> list[str]:
        model = litellm_model(self.check_format(launch.api_format), launch.model)
        metadata = str(launch.home / METADATA)
        models = ["--model", model, "--weak-model", model, "--model-metadata-file", metadata]
        message = ["--edit-format", EDIT_FORMAT, "--message", launch.task_prompt]
        histories = [arg for flag, name in HISTORY_FLAGS.items() for arg in (flag, str(launch.home / name))]
        return [*models, *message, *HEADLESS_FLAGS, *histories]

    def agent_env(self, launch: Launch) -> dict[str, str]:
        fmt = self.check_format(launch.api_format)
        return {**sdk_env(launch, fmt, LITELLM_URL_ENV), **LITELLM_OFFLINE}

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
