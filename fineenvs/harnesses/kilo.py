"""Kilo CLI (``@kilocode/cli``): any of the four formats through an AI SDK provider block.

Kilo CLI is a fork of OpenCode, so its configuration is OpenCode's (``provider.<id>.npm`` picks
the bundled AI SDK client, ``options.baseURL`` the endpoint) under Kilo's own names:
``KILO_CONFIG`` for the config file, ``KILO_*`` switches. Unlike OpenCode it honours a step
limit: ``agent.<name>.steps`` ("maximum number of agentic iterations before forcing text-only
response") on its default agent, ``code``.

Pinned at 7.7.7: the newest release whose platform package (``@kilocode/cli-linux-x64``, which
holds the native binary) is published at the same version; 7.8.1's is not.
"""

from __future__ import annotations

from fineenvs.harnesses.base import Launch
from fineenvs.harnesses.opencode import PROVIDER, OpenCode
from fineenvs.jsonl import JsonObject

AGENT = "code"
# Not `openai` or `kilo` as the provider's id (``PROVIDER``): those names select Kilo's own
# built-in provider definitions.


class Kilo(OpenCode):
    name = "kilo"
    honours_step_limit = True  # agent.code.steps
    schema_url = "https://app.kilo.ai/config.json"
    config_file = ".config/kilo/kilo.json"
    env_prefix = "KILO"
    run_flags = ("--auto", "--pure")

    def extra_config(self, launch: Launch) -> JsonObject:
        agent: JsonObject = {"steps": launch.step_limit} if launch.step_limit is not None else {}
        return {
            "default_agent": AGENT,
            # Only ours: the built-in `kilo` gateway provider otherwise fetches its model list.
            "enabled_providers": [PROVIDER],
            "agent": {AGENT: agent},
        }

    def workdir_flags(self, launch: Launch) -> list[str]:
        return ["--dir", str(launch.workdir)]

    def extra_env(self) -> dict[str, str]:
        return {
            "KILO_TELEMETRY_LEVEL": "off",
            "KILO_DISABLE_SESSION_INGEST": "1",
            "KILO_DISABLE_CODEBASE_INDEXING": "1",
            "KILO_DISABLE_EXTERNAL_SKILLS": "1",
            "KILO_DISABLE_PROJECT_CONFIG": "1",
            "KILO_NO_DAEMON": "1",
        }
