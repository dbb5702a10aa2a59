"""OpenCode (``opencode-ai``): any of the four formats through an AI SDK provider block."""

from __future__ import annotations

from fineenvs.api_formats import ApiFormat
from fineenvs.harnesses.base import Launch, NpmHarness, strip_v1, with_v1
from fineenvs.jsonl import JsonObject

# Never call the provider `openai`: opencode then routes to its own Responses client and dies
# ("Z.responses is not a function", published system §4.11).
PROVIDER = "fineenvs"
HEADLESS_FLAGS = ("run", "--format", "json")
SDK_BY_FORMAT: dict[str, str] = {
    ApiFormat.openai_chat: "@ai-sdk/openai-compatible",
    ApiFormat.openai_responses: "@ai-sdk/openai",
    ApiFormat.anthropic_messages: "@ai-sdk/anthropic",
    ApiFormat.gemini: "@ai-sdk/google",
}


def _base_for(fmt: str, base_url: str) -> str:
    if fmt == ApiFormat.gemini:
        return strip_v1(base_url) + "/v1beta"
    return with_v1(base_url)


class OpenCode(NpmHarness):
    """OpenCode, and the base of its forks (Kilo CLI): what a fork names differently is a class
    attribute or a hook (``extra_config``, ``run_flags``, ``workdir_flags``, ``extra_env``)."""

    name = "opencode"
    output_detail = "run --format json"
    schema_url = "https://opencode.ai/config.json"
    config_file = ".config/opencode/opencode.json"
    env_prefix = "OPENCODE"
    run_flags: tuple[str, ...] = ()

    def config_files(self, launch: Launch, fmt: str) -> dict[str, JsonObject]:
        model = launch.model
        config = {
            "$schema": self.schema_url,
            "model": f"{PROVIDER}/{model}",
            "small_model": f"{PROVIDER}/{model}",
            "autoupdate": False,
            "share": "disabled",
            # Training profile of the published system: no subagents, no questions, no web.
            "tools": {"task": False, "question": False, "webfetch": False, "websearch": False},
            "permission": {"bash": "allow", "edit": "allow", "webfetch": "deny"},
            "provider": {
                PROVIDER: {
                    "npm": SDK_BY_FORMAT[fmt],
                    "name": "fineenvs proxy",
                    "options": {
                        "baseURL": _base_for(fmt, launch.base_url),
                        "apiKey": launch.session_key,
                        "timeout": 600000,
                    },
                    "models": {
                        model: {
                            "name": model,
                            "tool_call": True,
                            "limit": {"context": 200000, "output": 8192},
                        }
                    },
                }
            },
            **self.extra_config(launch),
        }
        return {self.config_file: config}

    def extra_config(self, launch: Launch) -> JsonObject:
        """Keys a fork adds to the config."""
        return {}

    def arguments(self, launch: Launch) -> list[str]:
        flags = [*HEADLESS_FLAGS, *self.run_flags, "--model", f"{PROVIDER}/{launch.model}"]
        # One quoted argument reaches the model with literal quotes around it; words do not.
        return [*flags, *self.workdir_flags(launch), *launch.task_prompt.split()]

    def workdir_flags(self, launch: Launch) -> list[str]:
        """OpenCode runs in its working directory; a fork may name it."""
        return []

    def agent_env(self, launch: Launch) -> dict[str, str]:
        p = self.env_prefix
        switches = ("AUTOUPDATE", "MODELS_FETCH", "SHARE", "LSP_DOWNLOAD", "DEFAULT_PLUGINS", "CLAUDE_CODE")
        return {
            f"{p}_CONFIG": str(launch.home / self.config_file),
            **{f"{p}_DISABLE_{switch}": "1" for switch in switches},
            **self.extra_env(),
        }

    def extra_env(self) -> dict[str, str]:
        """Switches a fork adds."""
        return {}

    def read_events(self, events: list[JsonObject]) -> tuple[str | None, int | None]:
        tool_calls = 0
        texts: list[str] = []
        for ev in events:
            kind = ev.get("type")
            part = ev.get("part") or {}
            if kind == "tool_use":
                tool_calls += 1
            elif kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
        return (texts[-1] if texts else None), tool_calls
