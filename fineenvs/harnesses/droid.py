"""Factory Droid (``@factory/cli``): Chat, Responses or Messages through a custom model.

A ``customModels`` entry in ``~/.factory/settings.json`` names the endpoint (``baseUrl``), key and
client: ``generic-chat-completion-api`` (OpenAI Chat), ``openai`` (OpenAI Responses) or
``anthropic`` (Anthropic Messages). ``droid exec -m custom:<model>`` runs it headless;
``--auto high`` lets it run shell commands without asking.

The npm wrapper 0.225.1 is the newest published; the linux-x64 binary it names at the same
version is not in the registry, so the install pins the wrapper and the binary package's newest
release, 0.225.2, next to it (the wrapper's postinstall links whichever binary package it finds).
``droid --version`` reports 0.225.2.

Not covered: a step limit (droid exec has none), Gemini (a custom model with ``provider:
"google"`` is refused when the settings load: "Unsupported custom model provider").
"""

from __future__ import annotations

from fineenvs.api_formats import ApiFormat
from fineenvs.harnesses.base import Launch, NpmHarness, sdk_base_url
from fineenvs.jsonl import JsonObject

PROVIDER_BY_FORMAT: dict[str, str] = {
    ApiFormat.openai_chat: "generic-chat-completion-api",
    ApiFormat.openai_responses: "openai",
    ApiFormat.anthropic_messages: "anthropic",
}
BINARY_PACKAGE = "@factory/cli-linux-x64"
BINARY_VERSION = "0.225.2"
# The local coding tools; the rest (Slack, missions, connectors, web, image generation) need
# Factory's cloud.
TOOLS = ("Read", "LS", "Execute", "Edit", "ApplyPatch", "Grep", "Glob", "Create", "TodoWrite")
EXEC_FLAGS = ("exec", "--auto", "high")
HEADLESS_FLAGS = ("--only-tools", ",".join(TOOLS), "-o", "stream-json")


class Droid(NpmHarness):
    name = "droid"
    extra_requirements = (f"{BINARY_PACKAGE}@{BINARY_VERSION}",)
    output_detail = "-o stream-json"

    def config_files(self, launch: Launch, fmt: str) -> dict[str, JsonObject]:
        model = {
            "model": launch.model,
            "displayName": launch.model,
            "baseUrl": sdk_base_url(fmt, launch.base_url),
            "apiKey": launch.session_key,
            "provider": PROVIDER_BY_FORMAT[fmt],
            "maxOutputTokens": 8192,
            "maxContextLimit": 200000,
            "noImageSupport": True,
        }
        settings = {
            "customModels": [model],
            "autoUpdateEnabled": False,
            "enableCustomDroids": False,
            "includeCoAuthoredByDroid": False,
        }
        return {".factory/settings.json": settings}

    def arguments(self, launch: Launch) -> list[str]:
        model = f"custom:{launch.model}"
        return [*EXEC_FLAGS, "-m", model, *HEADLESS_FLAGS, "--cwd", str(launch.workdir), launch.task_prompt]

    def agent_env(self, launch: Launch) -> dict[str, str]:
        return {
            "FACTORY_AIRGAP_ENABLED": "true",
            "FACTORY_DROID_AUTO_UPDATE_ENABLED": "false",
            "FACTORY_DISABLE_KEYRING": "1",
        }

    def read_events(self, events: list[JsonObject]) -> tuple[str | None, int | None]:
        final: str | None = None
        for ev in events:
            if ev.get("type") == "completion" and isinstance(ev.get("finalText"), str):
                final = ev["finalText"]
            elif (
                ev.get("type") == "message"
                and ev.get("role") == "assistant"
                and isinstance(ev.get("text"), str)
            ):
                final = ev["text"] or final
        return final, sum(1 for ev in events if ev.get("type") == "tool_call")
