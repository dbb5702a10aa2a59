"""Checkpoints of ``CapturedGRPOTrainer``: enough to resume exactly, in a layout engines reload.

A checkpoint directory holds:

- ``config.json``, ``model.safetensors``, ``generation_config.json`` and the tokenizer files
  (``save_pretrained`` layout): the embedded engine and vLLM load the directory as a model;
- ``optimizer.pt`` and ``scheduler.pt``: optimizer moments and LR schedule position;
- ``rng_state.pt``: Python, torch (CPU and CUDA) random states;
- ``trainer_state.json``: global step, policy version, settings, TRL version.

The directory is written under a ``.partial`` name and renamed when complete, so a crash mid-save
never leaves a directory that looks like a checkpoint.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from fineenvs.jsonl import JsonObject

if TYPE_CHECKING:
    from accelerate import Accelerator
    from torch.optim.lr_scheduler import LRScheduler
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

STATE_FILE = "trainer_state.json"
REQUIRED = ("config.json", "optimizer.pt", "scheduler.pt", STATE_FILE)


class CheckpointedTrainer(Protocol):
    """What a checkpoint reads and restores (``CapturedGRPOTrainer`` has it; this module needs no
    import of the trainer, which calls into it)."""

    model_dir: Path
    accelerator: Accelerator
    tokenizer: PreTrainedTokenizerBase
    optimizer: torch.optim.Optimizer
    lr_scheduler: LRScheduler

    @property
    def unwrapped_model(self) -> PreTrainedModel: ...

    def state_dict(self, dtype: torch.dtype | str | None = None) -> dict[str, torch.Tensor]: ...

    def trainer_state(self) -> JsonObject: ...

    def restore_trainer_state(self, state: JsonObject) -> None: ...


def save_checkpoint(trainer: CheckpointedTrainer, directory: Path) -> Path:
    """Write ``trainer``'s full state to ``directory`` (replacing it); return the directory."""
    acc = trainer.accelerator
    state_dict = trainer.state_dict()  # collective under FSDP: every process takes part
    acc.wait_for_everyone()
    if acc.is_main_process:
        partial = directory.with_name(directory.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        trainer.unwrapped_model.save_pretrained(partial, state_dict=state_dict, safe_serialization=True)
        trainer.tokenizer.save_pretrained(partial)
        torch.save(trainer.optimizer.state_dict(), partial / "optimizer.pt")
        torch.save(trainer.lr_scheduler.state_dict(), partial / "scheduler.pt")
        torch.save(_rng_state(), partial / "rng_state.pt")
        (partial / STATE_FILE).write_text(json.dumps(trainer.trainer_state(), indent=2, sort_keys=True))
        if directory.exists():
            shutil.rmtree(directory)
        partial.rename(directory)
    acc.wait_for_everyone()
    return directory


def load_checkpoint(trainer: CheckpointedTrainer, directory: Path) -> None:
    """Restore weights, optimizer, scheduler, RNG and step counters from ``directory``."""
    from safetensors.torch import load_file

    missing = [name for name in REQUIRED if not (directory / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{directory} is not a CapturedGRPOTrainer checkpoint: missing {missing}. Pass a directory "
            "written by save_checkpoint (a plain model directory has no optimizer state; start a new "
            "trainer from it instead)."
        )
    files = sorted(directory.glob("model*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} has no model*.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    model = trainer.unwrapped_model
    result = model.load_state_dict(weights, strict=False)
    tied = _tied_keys(model)
    really_missing = [k for k in result.missing_keys if k not in tied]
    if really_missing or result.unexpected_keys:
        raise ValueError(
            f"{directory} does not match the trainer's model ({trainer.model_dir}): missing "
            f"{really_missing[:5]}, unexpected {result.unexpected_keys[:5]}. Resume with the model the "
            "checkpoint was trained from."
        )
    device = trainer.accelerator.device
    trainer.optimizer.load_state_dict(
        torch.load(directory / "optimizer.pt", map_location=device, weights_only=True)
    )
    trainer.lr_scheduler.load_state_dict(torch.load(directory / "scheduler.pt", weights_only=False))
    rng = directory / "rng_state.pt"
    if rng.is_file():
        _set_rng_state(torch.load(rng, weights_only=False))
    state = json.loads((directory / STATE_FILE).read_text())
    trainer.restore_trainer_state(state)


def _tied_keys(model: PreTrainedModel) -> set[str]:
    tied = getattr(model, "_tied_weights_keys", None) or {}
    keys = set(tied) if not isinstance(tied, dict) else set(tied)
    if getattr(model.config, "tie_word_embeddings", False):
        keys.add("lm_head.weight")
    return keys


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
