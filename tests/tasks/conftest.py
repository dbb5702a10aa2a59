"""Fixtures for the task tests: one generated demo set per session, in a temporary directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from fineenvs.tasks import DEMO_SEED, generate_demo


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_demo(tmp_path_factory.mktemp("demo") / "set", DEMO_SEED)
