"""Tiny offline models (random-initialised, locally trained tokenizers, real chat templates)."""

from fineenvs.models.tiny import TINY_MODELS, TinyModelSpec, ToolCallFormat, ensure_tiny_model

__all__ = ["TINY_MODELS", "TinyModelSpec", "ToolCallFormat", "ensure_tiny_model"]
