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

import json
import sys
from pathlib import Path

from fineenvs.harnesses.base import (
    ANTHROPIC_MESSAGES,
    GEMINI,
    OPENAI_CHAT,
    OPENAI_RESPONSES,
    Harness,
    Launch,
    Outputs,
    iter_json_lines,
    node_bin_dir,
    read_text,
    strip_v1,
    with_v1,
)

ALIAS = "fineenvs"
TYPE_BY_FORMAT = {
    OPENAI_CHAT: "openai",
    OPENAI_RESPONSES: "openai_responses",
    ANTHROPIC_MESSAGES: "anthropic",
    GEMINI: "google-genai",
}
RIPGREP = "ripgrep==14.1.0"
RIPGREP_DIR = "ripgrep"
CONTEXT_SIZE = 200000


def _q(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


class KimiCode(Harness):
    name = "kimi_code"
    package = "@moonshot-ai/kimi-code"
    registry = "npm"
    version = "2.1.0"
    binary = "kimi"
    api_formats = (OPENAI_CHAT, OPENAI_RESPONSES, ANTHROPIC_MESSAGES, GEMINI)
    default_format = OPENAI_CHAT
    honours_step_limit = True  # loop_control.max_steps_per_turn

    def post_install(self, prefix: Path) -> list[tuple[list[str], dict[str, str]]]:
        env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(prefix / "install-home")}
        pip = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-deps"]
        target = str(prefix / RIPGREP_DIR)
        return [([*pip, "--only-binary=:all:", "--target", target, RIPGREP], env)]

    def write_config(self, launch: Launch) -> None:
        fmt = self.check_format(launch.api_format)
        # The Anthropic and Google SDKs append their API version themselves; the OpenAI clients
        # want it in the base URL.
        url = strip_v1(launch.base_url) if fmt in (ANTHROPIC_MESSAGES, GEMINI) else with_v1(launch.base_url)
        lines = [
            f"default_model = {_q(ALIAS)}",
            "telemetry = false",
            "",
            f"[providers.{ALIAS}]",
            f"type = {_q(TYPE_BY_FORMAT[fmt])}",
            f"base_url = {_q(url)}",
            f"api_key = {_q(launch.session_key)}",
            "",
            f"[models.{ALIAS}]",
            f"provider = {_q(ALIAS)}",
            f"model = {_q(launch.model)}",
            f"max_context_size = {CONTEXT_SIZE}",
            # Capabilities are guessed from the model name; an unknown name gets none, and
            # without tool_use the agent would have no tools.
            'capabilities = ["tool_use"]',
        ]
        if launch.step_limit is not None:
            lines += ["", "[loop_control]", f"max_steps_per_turn = {launch.step_limit}"]
        cfg = launch.home / ".kimi-code"
        cfg.mkdir(parents=True, exist_ok=True)
        (cfg / "config.toml").write_text("\n".join(lines) + "\n")
        (cfg / "tui.toml").write_text("[upgrade]\nauto_install = false\n")

    def command(self, launch: Launch) -> list[str]:
        return [str(self.binary_path), "-p", launch.task_prompt, "--output-format", "stream-json"]

    def env(self, launch: Launch) -> dict[str, str]:
        env = self.base_env(launch.home)
        path = [str(self.bin_dir), str(self.install_dir / RIPGREP_DIR / "bin"), node_bin_dir()]
        env["PATH"] = ":".join([*path, *(p for p in env["PATH"].split(":") if p not in path)])
        env.update(
            {
                "KIMI_CODE_HOME": str(launch.home / ".kimi-code"),
                "KIMI_DISABLE_TELEMETRY": "1",
                "KIMI_CODE_NO_AUTO_UPDATE": "1",
            }
        )
        return env

    def parse_outputs(self, attempt_dir: Path) -> Outputs:
        # stream-json: one message per line; an assistant message lists the tool calls it makes,
        # a tool message carries each result.
        events = iter_json_lines(read_text(attempt_dir / "stdout.txt"))
        tool_calls = 0
        final: str | None = None
        for ev in events:
            if ev.get("role") != "assistant":
                continue
            calls = ev.get("tool_calls")
            tool_calls += len(calls) if isinstance(calls, list) else 0
            text = _text(ev.get("content"))
            if text.strip():
                final = text
        return Outputs(
            final_text=final,
            native_tool_calls=tool_calls if events else None,
            detail="--output-format stream-json",
        )


def _text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""
