"""Training on captured rows.

- ``rows``: ``TrainRow`` (the trainer's input) and ``group_advantages`` (pure).
- ``grpo_config``: ``GRPOSettings`` (every RL training setting, the ``trainer=grpo`` schema);
  ``grpo``: ``CapturedGRPOTrainer`` (GRPO on TRL 1.16's loss).
- ``batching``: normalisation weights and micro-batches; ``trl_compat``: every TRL-internal touch.
- ``checkpoint``: save / resume; ``accelerate/``: launch configs; ``python -m fineenvs.train``:
  a few steps on a tiny model (also under ``accelerate launch``).

Importing this package is cheap; torch and TRL load with ``fineenvs.train.grpo``.
"""

from fineenvs.train.train_rows import TrainRow, group_advantages, reward_std

__all__ = ["TrainRow", "group_advantages", "reward_std"]
