"""Every agent's pin, in one table: what the installer installs and runs, and the wire formats the
agent speaks (the first is the one it speaks unless told otherwise).

Like a lockfile: bumping an agent is one line here (then re-record its fixtures and run the
harness tier). The adapters (one module per agent) say how each agent is configured and started.
"""

from __future__ import annotations

from dataclasses import dataclass

from fineenvs.api_formats import ApiFormat

CHAT = ApiFormat.openai_chat.value
RESPONSES = ApiFormat.openai_responses.value
MESSAGES = ApiFormat.anthropic_messages.value
GEMINI = ApiFormat.gemini.value


@dataclass(frozen=True)
class Pin:
    package: str  # on the adapter's registry (npm or PyPI)
    version: str
    binary: str  # the command the package installs
    api_formats: tuple[str, ...]


PINS: dict[str, Pin] = {
    "claude_code": Pin("@anthropic-ai/claude-code", "2.1.197", "claude", (MESSAGES,)),
    "codex": Pin("@openai/codex", "0.171.0", "codex", (RESPONSES,)),
    "opencode": Pin("opencode-ai", "1.18.33", "opencode", (CHAT, RESPONSES, MESSAGES, GEMINI)),
    "mini_swe_agent": Pin("mini-swe-agent", "2.4.6", "mini", (CHAT, MESSAGES)),
    "hermes": Pin("hermes-agent", "0.19.0", "hermes", (CHAT, MESSAGES, RESPONSES)),
    "pi": Pin("@mariozechner/pi-coding-agent", "0.73.1", "pi", (CHAT, RESPONSES, MESSAGES, GEMINI)),
    "gemini_cli": Pin("@google/gemini-cli", "0.61.0", "gemini", (GEMINI,)),
    "qwen_code": Pin("@qwen-code/qwen-code", "0.15.10", "qwen", (CHAT, MESSAGES, GEMINI)),
    "mistral_vibe": Pin("mistral-vibe", "3.0.2", "vibe", (CHAT,)),
    "openhands": Pin("openhands-sdk", "1.58.2", "python", (CHAT,)),
    "cline": Pin("cline", "3.0.65", "cline", (CHAT,)),
    "gptme": Pin("gptme", "0.35.1", "gptme", (CHAT,)),
    "copilot": Pin("@github/copilot", "1.0.102", "copilot", (CHAT, RESPONSES, MESSAGES)),
    "kilo": Pin("@kilocode/cli", "7.7.7", "kilo", (CHAT, RESPONSES, MESSAGES, GEMINI)),
    "droid": Pin("@factory/cli", "0.225.1", "droid", (CHAT, RESPONSES, MESSAGES)),
    "aider": Pin("aider-chat", "0.86.2", "aider", (CHAT, MESSAGES)),
    "kimi_code": Pin("@moonshot-ai/kimi-code", "2.1.0", "kimi", (CHAT, RESPONSES, MESSAGES, GEMINI)),
}
