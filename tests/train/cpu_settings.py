"""Trainer settings for the CPU tests: float32, no gradient checkpointing, the padded path.

``GRPOSettings``' defaults are the published runs' (bfloat16 autocast, checkpointing, shared
prefixes); the tests that compare numbers to 1e-5 or time nothing want the plain float32 path
unless they ask for another.
"""

from __future__ import annotations

from typing import Any

from fineenvs.train.grpo_config import GRPOSettings


def cpu_settings(**change: Any) -> GRPOSettings:
    base: dict[str, Any] = {"dtype": "float32", "gradient_checkpointing": False, "prefix_sharing": "padded"}
    return GRPOSettings(**(base | change))
