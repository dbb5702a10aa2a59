"""Cline CLI (``cline``, npm): OpenAI Chat through its ``openai-compatible`` provider.

Stands in for Mistral Vibe (``mistral-vibe``): every mistral-vibe release requires Python >= 3.12
(3.12-only syntax in its modules), and this project's machines have Python 3.11 only. Cline is a
widely used tool-calling coding agent whose CLI ships as a native binary inside npm packages.
"""

from __future__ import annotations

from fineenvs.harnesses.base import Launch, NpmHarness, with_v1
from fineenvs.jsonl import JsonObject

PROVIDER = "openai-compatible"
HEADLESS_FLAGS = ("--json", "--auto-approve", "true")


class Cline(NpmHarness):
    name = "cline"
    output_detail = "--json events"

    def config_files(self, launch: Launch, fmt: str) -> dict[str, JsonObject]:
        # The file `cline auth -p openai -k KEY -m MODEL -b URL` writes.
        settings = {
            "provider": PROVIDER,
            "apiKey": launch.session_key,
            "model": launch.model,
            "baseUrl": with_v1(launch.base_url),
        }
        # Without updatedAt the entry fails cline's schema and it falls back to its own hosted
        # provider.
        entry = {"settings": settings, "updatedAt": "2026-01-01T00:00:00.000Z", "tokenSource": "manual"}
        providers = {"version": 1, "lastUsedProvider": PROVIDER, "modes": {}, "providers": {PROVIDER: entry}}
        return {".cline/data/settings/providers.json": providers}

    def arguments(self, launch: Launch) -> list[str]:
        # No -P/-m: passing the provider on the command line drops the baseUrl of providers.json
        # (cline then connects to its default endpoint); lastUsedProvider selects it instead.
        return [*HEADLESS_FLAGS, "-c", str(launch.workdir), "--compaction", "off", launch.task_prompt]

    # No agent_env, no CLINE_DIR/CLINE_DATA_DIR/--data-dir: with any of them cline ignores
    # providers.json and falls back to its hosted provider. The fresh HOME isolates ~/.cline instead.

    def read_events(self, events: list[JsonObject]) -> tuple[str | None, int | None]:
        tool_calls = 0
        final: str | None = None
        for ev in events:
            raw = ev.get("event")
            inner: JsonObject = raw if isinstance(raw, dict) else {}
            if ev.get("type") == "agent_event" and inner.get("type") == "iteration_end":
                count = inner.get("toolCallCount")
                tool_calls += count if isinstance(count, int) else 0
            elif ev.get("type") == "run_result" and isinstance(ev.get("text"), str):
                final = ev["text"]
        return final, tool_calls
