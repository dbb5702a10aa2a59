"""OpenHands (``openhands-sdk`` + ``openhands-tools``, PyPI, Python >= 3.12) via a small driver script."""

from __future__ import annotations

from pathlib import Path

from fineenvs.harnesses.base import OPENAI_CHAT, Harness


class OpenHands(Harness):
    name = "openhands"
    package = "openhands-sdk"
    registry = "pypi"
    version = "1.58.2"
    binary = "python"
    api_formats = (OPENAI_CHAT,)
    default_format = OPENAI_CHAT
    python_version = "3.12"
    extra_requirements = ("openhands-tools==1.58.2",)

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
