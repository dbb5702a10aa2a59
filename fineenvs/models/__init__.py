"""Models built locally, through the ``fineenvs.model_builders`` plugin group.

``model.source=tiny`` names a model that is built on this machine instead of read from the Hub or
a directory: the project's tiny offline models (``fineenvs_recipes.tiny``), which tests, the smoke
run and the mini-reproduction use. The serving and training code only knows the interface below.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, cast

from fineenvs.jsonl import JsonObject
from fineenvs.plugins import MODEL_BUILDERS, load_plugin


class ModelBuilder(Protocol):
    """Builds named models into a local directory that ``from_pretrained`` and vLLM load."""

    def names(self) -> list[str]:
        """The models this builder knows."""
        ...

    def config(self, name: str) -> JsonObject:
        """The model's ``config.json`` content, without building it (for the dry run's checks)."""
        ...

    def path(self, name: str, seed: int = 0) -> Path:
        """Where ``ensure(name, seed)`` puts the model; nothing is built."""
        ...

    def ensure(self, name: str, seed: int = 0) -> Path:
        """Build the model once (idempotent, safe under concurrency) and return its directory."""
        ...


def model_builder(name: str = "tiny") -> ModelBuilder:
    """The installed builder ``name`` (``model.source=tiny`` uses ``tiny``)."""
    return cast(ModelBuilder, load_plugin(MODEL_BUILDERS, name))
