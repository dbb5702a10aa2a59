"""Mistral Vibe (``mistral-vibe``, PyPI, Python >= 3.12): OpenAI Chat through a generic provider."""

from __future__ import annotations

from pathlib import Path

from fineenvs.harnesses.base import OPENAI_CHAT, Harness


class MistralVibe(Harness):
    name = "mistral_vibe"
    package = "mistral-vibe"
    registry = "pypi"
    version = "3.0.2"
    binary = "vibe"
    api_formats = (OPENAI_CHAT,)
    default_format = OPENAI_CHAT
    python_version = "3.12"

    def write_config(
        self,
        home: Path,
        workdir: Path,
        *,
        base_url: str,
        session_key: str,
        model: str,
        api_format: str,
        step_limit: int | None,
    ) -> None:
        raise NotImplementedError

    def command(
        self,
        task_prompt: str,
        *,
        home: Path,
        workdir: Path,
        model: str,
        api_format: str,
        step_limit: int | None = None,
    ) -> list[str]:
        raise NotImplementedError
