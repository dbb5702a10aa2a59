"""Real coding-agent CLIs, pinned, installed into the cache, run unmodified in a fresh HOME.

The ten agents of the published system plus seven more (Cline CLI, gptme, GitHub Copilot CLI,
Kilo CLI, Factory Droid, Aider, Kimi Code CLI).
Mistral Vibe and OpenHands need Python >= 3.12: their venvs are built with the machine's pyenv
3.12 interpreter (``python_version``), the rest of the project stays on 3.11.

``HARNESSES`` maps a harness name to its adapter; ``check_installed`` is what the run entry
point calls before a job starts; ``run_attempt`` (in :mod:`fineenvs.harnesses.sandbox`) runs one
attempt in isolation.
"""

from __future__ import annotations

from collections.abc import Iterable

from fineenvs.harnesses.aider import Aider
from fineenvs.harnesses.base import API_FORMATS, Harness, HarnessConfigError, Outputs
from fineenvs.harnesses.claude_code import ClaudeCode
from fineenvs.harnesses.cline import Cline
from fineenvs.harnesses.codex import Codex
from fineenvs.harnesses.copilot import Copilot
from fineenvs.harnesses.droid import Droid
from fineenvs.harnesses.gemini_cli import GeminiCli
from fineenvs.harnesses.gptme import Gptme
from fineenvs.harnesses.hermes import Hermes
from fineenvs.harnesses.kilo import Kilo
from fineenvs.harnesses.kimi_code import KimiCode
from fineenvs.harnesses.mini_swe_agent import MiniSweAgent
from fineenvs.harnesses.mistral_vibe import MistralVibe
from fineenvs.harnesses.opencode import OpenCode
from fineenvs.harnesses.openhands import OpenHands
from fineenvs.harnesses.pi import Pi
from fineenvs.harnesses.qwen_code import QwenCode

HARNESSES: dict[str, Harness] = {
    h.name: h
    for h in (
        ClaudeCode(),
        Codex(),
        OpenCode(),
        MiniSweAgent(),
        Hermes(),
        Pi(),
        GeminiCli(),
        QwenCode(),
        MistralVibe(),
        OpenHands(),
        Cline(),
        Gptme(),
        Copilot(),
        Kilo(),
        Droid(),
        Aider(),
        KimiCode(),
    )
}


# Agents looked at and left out, with the reason (docs/agents.md).
UNAVAILABLE = {
    "crush": "@charmland/crush installs by downloading its Go binary from a GitHub release, which "
    "this project's machines cannot reach (only PyPI, npm and Debian), and no registry ships it",
}


def get_harness(name: str) -> Harness:
    """The adapter for ``name`` (a clear error listing the known names otherwise)."""
    key = name.replace("-", "_")
    if key not in HARNESSES:
        why = f"harness {name!r} has no adapter: {UNAVAILABLE[key]}" if key in UNAVAILABLE else ""
        raise HarnessConfigError(
            f"{why or f'unknown harness {name!r}'}; known harnesses: {', '.join(sorted(HARNESSES))}"
        )
    return HARNESSES[key]


def resolve_names(names: Iterable[str]) -> list[Harness]:
    """Harness adapters for ``names``; ``all`` means every harness."""
    out: list[Harness] = []
    for name in names:
        chosen = list(HARNESSES.values()) if name == "all" else [get_harness(name)]
        out.extend(h for h in chosen if h not in out)
    return out


def check_installed(names: Iterable[str]) -> list[str]:
    """Problems (missing or wrong version, with the exact install command) for the named harnesses."""
    from fineenvs.harnesses.installer import problems

    try:
        harnesses = resolve_names(names)
    except HarnessConfigError as exc:
        return [str(exc)]
    return problems(harnesses)


__all__ = [
    "API_FORMATS",
    "HARNESSES",
    "Harness",
    "HarnessConfigError",
    "Outputs",
    "check_installed",
    "get_harness",
    "resolve_names",
]
