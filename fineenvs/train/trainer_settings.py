"""``TrainerSettings``: what the GRPO and SFT settings share (the optimizer's schedule and how a bad
setting is reported). Like its subclasses, this module imports neither torch nor TRL."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class TrainerSettings:
    learning_rate: float = 3e-6
    lr_scheduler_type: str = "constant"
    warmup_steps: int = 0

    def problems(self) -> list[str]:
        """Every bad field, each with the fix, as ``trainer.<field>`` (the YAML key)."""
        return []

    def check(self) -> None:
        """Raise ``ValueError`` listing every bad field with the fix."""
        if p := self.problems():
            raise ValueError("trainer settings: " + "; ".join(p))


def not_one_of(name: str, value: str, choices: Sequence[str], fix: str = "") -> list[str]:
    """The problem of a field ``trainer.<name>`` whose ``value`` is none of ``choices``, if any."""
    if value in choices:
        return []
    return [f"trainer.{name}={value!r} is not one of {', '.join(choices)}" + (f". Fix: {fix}" if fix else "")]
