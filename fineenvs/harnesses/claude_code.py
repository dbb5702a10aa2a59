"""Claude Code (``@anthropic-ai/claude-code``): Anthropic Messages, headless ``claude -p``."""

from __future__ import annotations

from pathlib import Path

from fineenvs.harnesses.base import (
    ANTHROPIC_MESSAGES,
    Harness,
    Launch,
    Outputs,
    iter_json_lines,
    read_text,
    strip_v1,
    write_json,
)

# Tools a coding task needs; the rest (web, agents, cron, ...) stay unapproved in -p mode.
ALLOWED_TOOLS = ("Bash", "Read", "Write", "Edit", "Glob", "Grep")


class ClaudeCode(Harness):
    name = "claude_code"
    package = "@anthropic-ai/claude-code"
    registry = "npm"
    version = "2.1.197"
    binary = "claude"
    api_formats = (ANTHROPIC_MESSAGES,)
    default_format = ANTHROPIC_MESSAGES
    honours_step_limit = True  # --max-turns in print mode

    def write_config(self, launch: Launch) -> None:
        self.check_format(launch.api_format)
        # Permissions live in settings (not env) so they are visible in the attempt folder.
        write_json(
            launch.home / ".claude" / "settings.json",
            {
                "permissions": {"allow": list(ALLOWED_TOOLS), "defaultMode": "acceptEdits"},
                "includeCoAuthoredBy": False,
                "cleanupPeriodDays": 1,
            },
        )
        write_json(launch.home / ".claude.json", {"hasCompletedOnboarding": True, "autoUpdates": False})

    def command(self, launch: Launch) -> list[str]:
        cmd = [
            str(self.binary_path),
            "-p",
            launch.task_prompt,
            "--allowedTools",
            ",".join(ALLOWED_TOOLS),
            "--output-format",
            "stream-json",
            "--verbose",
            "--model",
            launch.model,
        ]
        if launch.step_limit is not None:
            cmd += ["--max-turns", str(launch.step_limit)]
        return cmd

    def env(self, launch: Launch) -> dict[str, str]:
        env = self.base_env(launch.home)
        env.update(
            {
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
        )
        return env

    def parse_outputs(self, attempt_dir: Path) -> Outputs:
        events = iter_json_lines(read_text(attempt_dir / "stdout.txt"))
        tool_calls = 0
        final: str | None = None
        saw_any = False
        for ev in events:
            if ev.get("type") == "assistant":
                saw_any = True
                content = (ev.get("message") or {}).get("content") or []
                tool_calls += sum(1 for b in content if isinstance(b, dict) and b.get("type") == "tool_use")
            elif ev.get("type") == "result":
                result = ev.get("result")
                final = result if isinstance(result, str) else final
        return Outputs(
            final_text=final, native_tool_calls=tool_calls if saw_any else None, detail="stream-json"
        )
