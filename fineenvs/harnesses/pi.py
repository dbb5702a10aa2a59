"""Pi (``@mariozechner/pi-coding-agent``): any of the four formats via ``~/.pi/agent/models.json``."""

from __future__ import annotations

from fineenvs.api_formats import ApiFormat
from fineenvs.harnesses.base import Launch, NpmHarness, sdk_base_url
from fineenvs.harnesses.files import joined_text, typed_blocks
from fineenvs.jsonl import JsonObject

PROVIDER = "fineenvs"
KEY_ENV = "FINEENVS_SESSION_KEY"
HEADLESS_FLAGS = ("--mode", "json")
API_BY_FORMAT: dict[str, str] = {
    ApiFormat.openai_chat: "openai-completions",
    ApiFormat.openai_responses: "openai-responses",
    ApiFormat.anthropic_messages: "anthropic-messages",
    ApiFormat.gemini: "google-generative-ai",
}


class Pi(NpmHarness):
    name = "pi"
    output_detail = "--mode json"

    def config_files(self, launch: Launch, fmt: str) -> dict[str, JsonObject]:
        # Pi's Google client wants the API version in its base URL.
        url = sdk_base_url(fmt, launch.base_url) + ("/v1beta" if fmt == ApiFormat.gemini else "")
        # apiKey names an env var, so the key itself stays out of the file.
        provider = {
            "baseUrl": url,
            "api": API_BY_FORMAT[fmt],
            "apiKey": KEY_ENV,
            "models": [{"id": launch.model, "contextWindow": 200000, "maxTokens": 8192}],
        }
        return {".pi/agent/models.json": {"providers": {PROVIDER: provider}}}

    def arguments(self, launch: Launch) -> list[str]:
        return ["-p", launch.task_prompt, "--model", f"{PROVIDER}/{launch.model}", *HEADLESS_FLAGS]

    def agent_env(self, launch: Launch) -> dict[str, str]:
        return {KEY_ENV: launch.session_key, "PI_OFFLINE": "1", "PI_SKIP_VERSION_CHECK": "1"}

    def read_events(self, events: list[JsonObject]) -> tuple[str | None, int | None]:
        tool_calls = 0
        final: str | None = None
        saw = False
        for ev in events:
            msg = (ev.get("message") or {}) if ev.get("type") == "message_end" else {}
            if msg.get("role") != "assistant":
                continue
            saw = True
            parts = msg.get("content") or []
            tool_calls += len(typed_blocks(parts, "toolCall"))
            final = joined_text(parts) or final
        return final, tool_calls if saw else None
