"""The wire formats the proxy speaks to agents, named once.

Each is a format of model calls an agent may send (its path, body and streaming events): the run
config's ``harness.<name>.api_format`` chooses one, each harness adapter lists those its agent
speaks, and ``fineenvs.dialects`` converts each to and from the canonical request. A ``StrEnum``:
a member is its name wherever a string is expected (JSON, paths, config files).
"""

from __future__ import annotations

from enum import StrEnum


class ApiFormat(StrEnum):
    openai_chat = "openai_chat"  # OpenAI Chat Completions: POST /v1/chat/completions
    openai_responses = "openai_responses"  # OpenAI Responses: POST /v1/responses
    anthropic_messages = "anthropic_messages"  # Anthropic Messages: POST /v1/messages
    gemini = "gemini"  # Gemini: POST /v1beta/models/<model>:generateContent (or :streamGenerateContent)
