"""Kimi Code CLI (``@moonshot-ai/kimi-code``): Chat, Responses, Messages or Gemini through a provider.

The successor of the Python Kimi CLI (``kimi-cli`` on PyPI, archived: its last release, 1.52.0,
only prints a deprecation notice and fetches an installer script from a CDN). A provider in
``$KIMI_CODE_HOME/config.toml`` names the endpoint, key and client: ``openai`` (Chat
Completions), ``openai_responses``, ``anthropic`` or ``google-genai``. ``kimi -p PROMPT
--output-format stream-json`` runs one prompt headless under its ``auto`` permission policy (no
approvals, no questions); ``loop_control.max_steps_per_turn`` is the step limit.

Runtime: the CLI needs Node >= 22.19 (``node:sqlite``): the pinned Node every npm agent runs on
(fineenvs/harnesses/node.py) is one, on the agent's PATH, where the CLI's ``#!/usr/bin/env node``
finds it.

ripgrep: the Grep and Glob tools run ``rg``; without one on PATH the CLI downloads it from its
CDN when a tool first needs it. The install step puts ripgrep's own binary wheel from PyPI
(``ripgrep``, the last release with a Linux wheel) into the prefix, and PATH names it.

Off: telemetry (``telemetry = false``, ``KIMI_DISABLE_TELEMETRY``), the update preflight
(``KIMI_CODE_NO_AUTO_UPDATE``, ``[upgrade] auto_install = false`` in ``tui.toml``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from fineenvs.api_formats import ApiFormat
from fineenvs.harnesses.base import Launch, NpmHarness, sdk_base_url
from fineenvs.harnesses.files import joined_text
from fineenvs.jsonl import JsonObject

ALIAS = "fineenvs"
TYPE_BY_FORMAT: dict[str, str] = {
    ApiFormat.openai_chat: "openai",
    ApiFormat.openai_responses: "openai_responses",
    ApiFormat.anthropic_messages: "anthropic",
    ApiFormat.gemini: "google-genai",
}
RIPGREP = "ripgrep==14.1.0"
RIPGREP_DIR = "ripgrep"
CONTEXT_SIZE = 200000
HEADLESS_FLAGS = ("--output-format", "stream-json")


class KimiCode(NpmHarness):
    name = "kimi_code"
    honours_step_limit = True  # loop_control.max_steps_per_turn
    output_detail = "--output-format stream-json"

    def post_install(self, prefix: Path) -> list[tuple[list[str], dict[str, str]]]:
        env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(prefix / "install-home")}
        pip = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-deps"]
        target = str(prefix / RIPGREP_DIR)
        return [([*pip, "--only-binary=:all:", "--target", target, RIPGREP], env)]

    def config_files(self, launch: Launch, fmt: str) -> dict[str, JsonObject]:
        provider = {
            "type": TYPE_BY_FORMAT[fmt],
            "base_url": sdk_base_url(fmt, launch.base_url),
            "api_key": launch.session_key,
        }
        # Capabilities are guessed from the model name; an unknown name gets none, and without
        # tool_use the agent would have no tools.
        model = {
            "provider": ALIAS,
            "model": launch.model,
            "max_context_size": CONTEXT_SIZE,
            "capabilities": ["tool_use"],
        }
        config: JsonObject = {
            "default_model": ALIAS,
            "telemetry": False,
            "providers": {ALIAS: provider},
            "models": {ALIAS: model},
        }
        if launch.step_limit is not None:
            config["loop_control"] = {"max_steps_per_turn": launch.step_limit}
        return {
            ".kimi-code/config.toml": config,
            ".kimi-code/tui.toml": {"upgrade": {"auto_install": False}},
        }

    def arguments(self, launch: Launch) -> list[str]:
        return ["-p", launch.task_prompt, *HEADLESS_FLAGS]

    def env(self, launch: Launch) -> dict[str, str]:
        env = super().env(launch)
        # ripgrep right after the agent's own executables, so that the CLI finds it on PATH.
        path = env["PATH"].split(":")
        env["PATH"] = ":".join([*path[:1], str(self.install_dir / RIPGREP_DIR / "bin"), *path[1:]])
        return env

    def agent_env(self, launch: Launch) -> dict[str, str]:
        return {
            "KIMI_CODE_HOME": str(launch.home / ".kimi-code"),
            "KIMI_DISABLE_TELEMETRY": "1",
            "KIMI_CODE_NO_AUTO_UPDATE": "1",
        }

    def read_events(self, events: list[JsonObject]) -> tuple[str | None, int | None]:
        # stream-json: one message per line; an assistant message lists the tool calls it makes,
        # a tool message carries each result.
        tool_calls = 0
        final: str | None = None
        for ev in events:
            if ev.get("role") != "assistant":
                continue
            calls = ev.get("tool_calls")
            tool_calls += len(calls) if isinstance(calls, list) else 0
            content = ev.get("content")
            text = content if isinstance(content, str) else joined_text(content)
            if text.strip():
                final = text
        return final, tool_calls
