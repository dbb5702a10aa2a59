"""Tiny offline models: the ``tiny`` model builder (``model.source=tiny``) and its direct API."""

from __future__ import annotations

from pathlib import Path

from fineenvs.jsonl import JsonObject
from fineenvs_recipes.tiny.build import (
    TINY_MODELS,
    TinyModelSpec,
    ensure_tiny_model,
    tiny_model_config,
    tiny_model_path,
)


class TinyModels:
    """The ``fineenvs.model_builders`` entry ``tiny``: ``fineenvs.models.ModelBuilder`` over ``TINY_MODELS``."""

    def names(self) -> list[str]:
        return sorted(TINY_MODELS)

    def config(self, name: str) -> JsonObject:
        return tiny_model_config(name)

    def path(self, name: str, seed: int = 0) -> Path:
        return tiny_model_path(name, seed=seed)

    def ensure(self, name: str, seed: int = 0) -> Path:
        return ensure_tiny_model(name, seed=seed)


BUILDER = TinyModels()

__all__ = [
    "BUILDER",
    "TINY_MODELS",
    "TinyModelSpec",
    "TinyModels",
    "ensure_tiny_model",
    "tiny_model_config",
    "tiny_model_path",
]
