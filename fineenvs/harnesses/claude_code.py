"""Claude Code (``@anthropic-ai/claude-code``): Anthropic Messages, headless ``claude -p``."""

from __future__ import annotations

from fineenvs.harnesses.base import Launch, NpmHarness, strip_v1
from fineenvs.harnesses.files import typed_blocks
from fineenvs.jsonl import JsonObject

# Tools a coding task needs; the rest (web, agents, cron, ...) stay unapproved in -p mode.
ALLOWED_TOOLS = ("Bash", "Read", "Write", "Edit", "Glob", "Grep")
HEADLESS_FLAGS = ("--allowedTools", ",".join(ALLOWED_TOOLS), "--output-format", "stream-json", "--verbose")


def read_stream_json(events: list[JsonObject]) -> tuple[str | None, int | None]:
    """The last ``result`` and the ``tool_use`` blocks of the assistant messages in Claude Code's
    stream-json events (Qwen Code prints the same); no count where no assistant message came."""
    tool_calls = 0
    final: str | None = None
    saw_any = False
    for ev in events:
        if ev.get("type") == "assistant":
            saw_any = True
            tool_calls += len(typed_blocks((ev.get("message") or {}).get("content"), "tool_use"))
        elif ev.get("type") == "result":
            result = ev.get("result")
            final = result if isinstance(result, str) else final
    return final, tool_calls if saw_any else None


class ClaudeCode(NpmHarness):
    name = "claude_code"
    honours_step_limit = True  # --max-turns in print mode
    output_detail = "stream-json"

    def config_files(self, launch: Launch, fmt: str) -> dict[str, JsonObject]:
        # Permissions live in settings (not env) so they are visible in the attempt folder.
        settings = {
            "permissions": {"allow": list(ALLOWED_TOOLS), "defaultMode": "acceptEdits"},
            "includeCoAuthoredBy": False,
            "cleanupPeriodDays": 1,
        }
        return {
            ".claude/settings.json": settings,
            ".claude.json": {"hasCompletedOnboarding": True, "autoUpdates": False},
        }

    def arguments(self, launch: Launch) -> list[str]:
        model = ["--model", launch.model, *launch.step_args("--max-turns")]
        return ["-p", launch.task_prompt, *HEADLESS_FLAGS, *model]

    def agent_env(self, launch: Launch) -> dict[str, str]:
        return {
            "ANTHROPIC_BASE_URL": strip_v1(launch.base_url),
            "ANTHROPIC_API_KEY": launch.session_key,
            "ANTHROPIC_MODEL": launch.model,
            "ANTHROPIC_SMALL_FAST_MODEL": launch.model,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": launch.model,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "DISABLE_BUG_COMMAND": "1",
            "CLAUDE_CONFIG_DIR": str(launch.home / ".claude"),
        }

    def read_events(self, events: list[JsonObject]) -> tuple[str | None, int | None]:
        return read_stream_json(events)
