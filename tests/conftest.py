"""Shared fixtures: tiny offline models and the engine-URL option of the contract suite.

Fixtures:
- ``tiny_model_factory(name, seed=0) -> Path``: build (once, cached) any tiny model.
- ``tiny_qwen_dir``, ``tiny_lfm2_dir``, ``tiny_qwen3_5_dir``: seed-0 model directories.
- ``tiny_model_dir``: parametrised over every tiny model (``request.param`` / ``tiny_model_name``).

Options: ``--engine-url=http://host:port`` points ``tests/engine/test_contract.py`` at an external
engine (vLLM) instead of the embedded one (run it with ``-m gpu``); ``--engine-model`` names its
served model, ``--engine-tokenizer`` where its tokenizer is, and ``--engine-weights`` (a local
copy of the served weights) turns on the forward-pass check with ``--engine-logprob-tol``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from fineenvs_recipes.tiny import TINY_MODELS, ensure_tiny_model

TINY_MODEL_NAMES = tuple(TINY_MODELS)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fineenvs")
    group.addoption(
        "--engine-url",
        default=None,
        help="run the engine contract suite against this OpenAI-compatible URL (e.g. a vLLM server) "
        "instead of the embedded engine; select it with -m gpu",
    )
    group.addoption(
        "--engine-model",
        default=None,
        help="served model name at --engine-url (default: the first id listed by GET /v1/models)",
    )
    group.addoption(
        "--engine-tokenizer",
        default=None,
        help="tokenizer (local dir or cached Hub id) of the model at --engine-url (default: the model id)",
    )
    group.addoption(
        "--engine-weights",
        default=None,
        help="local HF dir of the weights served at --engine-url: enables the forward-pass logprob check",
    )
    group.addoption(
        "--engine-logprob-tol",
        type=float,
        default=None,
        help="max |logprob - forward logprob| (default 1e-4 for the embedded engine, 5e-2 for --engine-url)",
    )


@pytest.fixture(scope="session")
def tiny_model_factory() -> Callable[..., Path]:
    def build(name: str, seed: int = 0) -> Path:
        return ensure_tiny_model(name, seed)

    return build


@pytest.fixture(scope="session")
def tiny_qwen_dir() -> Path:
    return ensure_tiny_model("tiny_qwen")


@pytest.fixture(scope="session")
def tiny_lfm2_dir() -> Path:
    return ensure_tiny_model("tiny_lfm2")


@pytest.fixture(scope="session")
def tiny_qwen3_5_dir() -> Path:
    return ensure_tiny_model("tiny_qwen3_5")


@pytest.fixture(scope="session", params=TINY_MODEL_NAMES)
def tiny_model_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_name: str) -> Path:
    return ensure_tiny_model(tiny_model_name)


@pytest.fixture(scope="session")
def docker_daemon() -> None:
    """A Docker daemon answers (the container tier: ``make test-containers`` starts one)."""
    from fineenvs.harnesses.container import daemon_problem

    problem = daemon_problem()
    if problem:
        pytest.fail(f"{problem} (make test-containers starts one: scripts/dockerd.sh start)")
