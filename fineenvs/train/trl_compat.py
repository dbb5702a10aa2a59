"""Every touch of TRL's internals, in one place (TRL pinned to 1.16.0).

The captured-row trainer reuses TRL's ``GRPOTrainer`` as a *loss function*: a real trainer is
constructed around our model (with a dummy dataset and a ``rollout_func`` that is never called),
and its ``_compute_loss`` runs on micro-batches we build from rows. TRL therefore owns the
per-token objective of every loss type (``dapo``, ``grpo``, ``dr_grpo``, ``bnpo``, ``cispo``,
``sapo``, ``luspo``, ``vespo``), PPO clipping (``epsilon``/``epsilon_high``), sequence-level
importance sampling (GSPO), temperature scaling and its fused, chunked log-prob head. It also
builds the optimizer and LR scheduler from its ``TrainingArguments`` (``optim``,
``lr_scheduler_type``, ...).

What we change, and how:

- ``old_per_token_logps`` are the engine's behaviour logprobs (no recompute of pi_old), as in
  TRL's AsyncGRPO: the PPO ratio is pi_theta / pi_behaviour.
- The ``use_vllm`` shim (``stack.md`` 1.1): ``use_vllm = True`` and
  ``vllm_importance_sampling_correction = True`` make ``_compute_loss`` multiply the per-token loss
  by ``inputs["importance_sampling_ratio"]``. We fill that tensor (from a wrapper around
  ``_get_per_token_logps_and_entropies``, once the trainer logprobs are known) with
  ``gate_t * w_t / c_t``: ``gate_t`` is the TIS / mask factor below, ``w_t`` our normalisation
  weight (``batching``), and ``c_t`` the coefficient TRL's own aggregation for ``loss_type`` gives
  token t in this micro-batch (``aggregation_coefficient``). TRL's returned loss is then exactly
  ``sum_t w_t * gate_t * l_t``: per-micro-batch sums that add up to the step's loss however the
  step is split (the fix for TRL #7249). ``vespo`` reads that tensor as a ratio instead of
  multiplying by it, so it gets ``gate_t`` only and supports ``per_token`` normalisation only.
- Importance sampling against the behaviour policy (TRL #7120, token level), with
  ``rho_t = exp(logp_theta - logp_behaviour)`` (detached): ``tis`` multiplies the per-token loss by
  ``min(rho, C) / rho``, so the effective importance weight on the gradient, which the PPO ratio
  already carries, is ``min(rho, C)`` rather than ``rho`` (the truncation of TRL's
  ``token_truncate``); ``mask`` zeroes tokens with ``rho`` outside ``[1/C, C]`` (TRL's
  ``token_mask``). Both off by default, as published.
- Prefix-shared training (``fineenvs.train.shared``) scores hidden states itself with TRL's
  chunked log-prob head (``token_logps``: ``ChunkedLogProbFunction`` with the temperature, logit
  scale and softcapping of ``add_fused_lm_head``) and hands ``_compute_loss`` those logprobs
  (``TrlLoss.__call__(precomputed=...)``), so TRL runs no forward of its own.
- ``beta`` (KL to the initial policy) is applied by the caller, not through TRL: TRL adds its KL
  term after the importance-sampling factor, so it would escape our normalisation weights.

TRL 1.16's ``AsyncGRPOTrainer`` cannot be used instead; measured on this CPU machine with the
three tiny models (``AsyncGRPOTrainer(model=<path>, args=AsyncGRPOConfig(use_cpu=True,
dtype="float32"), rollout_worker=<stub>, weight_transfer=<no-op>)``):

- ``tiny_lfm2``: ``ValueError: Lfm2ForCausalLM has ['conv'] layers. Tree packing only routes
  attention layers along each sample's own path; a recurrent or convolutional layer would scan
  across samples.`` (async_grpo_trainer.py L1097)
- ``tiny_qwen3_5``: the same ``ValueError`` with ``Qwen3_5ForCausalLM has ['linear_attention']
  layers``.
- ``tiny_qwen`` (attention only): ``AssertionError: Torch not compiled with CUDA enabled`` from
  ``trl/trainer/utils.py`` L1824 ``get_peak_flops_per_device`` -> ``torch.cuda.get_device_name``
  (async_grpo_trainer.py L1240).
- Its tree packing registers ``attn_implementation="tree_fa3"`` whose kernel is fetched from the
  Hub on first use (``kernels.get_kernel("kernels-community/flash-attn3")``, packing.py L161-165):
  here ``ModuleNotFoundError: No module named 'kernels'``, and with ``kernels`` installed it needs
  the Hub, which offline CI cannot reach.

``check_trl_internals`` fails loudly, naming the TRL version and the attribute, when anything used
here moves; ``tests/train/test_trl_compat.py`` runs it and checks the behaviour numerically.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from fineenvs.train.batching import MicroBatch
from fineenvs.train.grpo_config import (
    IMPORTANCE_SAMPLING,
    LOSS_TYPES,
    TRL_VERSION,
)

if TYPE_CHECKING:
    from accelerate import Accelerator
    from torch.optim.lr_scheduler import LRScheduler
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

# Source fragments of GRPOTrainer._compute_loss this module relies on; a refactor that drops one
# changes the semantics we depend on even if every attribute still exists.
_COMPUTE_LOSS_FRAGMENTS = (
    'inputs["importance_sampling_ratio"]',
    "self.use_vllm and self.vllm_importance_sampling_correction",
    'inputs.get("old_per_token_logps")',
    'inputs["num_items_in_batch"]',
    'completion_mask * inputs["tool_mask"]',
    "self.current_gradient_accumulation_steps",
    "self._get_per_token_logps_and_entropies(",
)


class TrlInternalsMoved(RuntimeError):
    """The installed TRL no longer has what ``fineenvs.train.trl_compat`` relies on."""


def _moved(what: str) -> TrlInternalsMoved:
    import trl

    return TrlInternalsMoved(
        f"fineenvs.train.trl_compat was written against trl=={TRL_VERSION}, installed trl=={trl.__version__}: "
        f"{what}. Pin trl=={TRL_VERSION} (pyproject.toml) or port fineenvs/train/trl_compat.py to the new "
        "GRPOTrainer internals."
    )


def check_trl_internals() -> None:
    """Raise ``TrlInternalsMoved`` (naming the version and the attribute) if TRL's internals moved."""
    import trl
    from trl.trainer.grpo_config import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer

    if trl.__version__ != TRL_VERSION:
        raise _moved(f"version differs from the pin (trl.__version__ = {trl.__version__!r})")
    from trl.trainer import utils as trl_utils

    if not callable(getattr(trl_utils, "add_fused_lm_head", None)):
        raise _moved("trl.trainer.utils.add_fused_lm_head is missing")
    if not isinstance(getattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", None), int):
        raise _moved("trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE is missing")
    from trl import kernels as trl_kernels

    if not hasattr(getattr(trl_kernels, "ChunkedLogProbFunction", None), "apply"):
        raise _moved("trl.kernels.ChunkedLogProbFunction is missing")
    for name in ("_compute_loss", "_get_per_token_logps_and_entropies", "create_optimizer_and_scheduler"):
        if not callable(getattr(GRPOTrainer, name, None)):
            raise _moved(f"GRPOTrainer.{name} is missing")
    params = list(inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies).parameters)
    if params[:5] != ["self", "model", "input_ids", "attention_mask", "logits_to_keep"]:
        raise _moved(f"GRPOTrainer._get_per_token_logps_and_entropies has parameters {params[:5]}")
    if "rollout_func" not in inspect.signature(GRPOTrainer.__init__).parameters:
        raise _moved("GRPOTrainer.__init__ no longer takes rollout_func")
    source = inspect.getsource(GRPOTrainer._compute_loss)
    for fragment in _COMPUTE_LOSS_FRAGMENTS:
        if fragment not in source:
            raise _moved(f"GRPOTrainer._compute_loss no longer contains {fragment!r}")
    for loss_type in LOSS_TYPES:
        if f'"{loss_type}"' not in source:
            raise _moved(f"GRPOTrainer._compute_loss no longer handles loss_type {loss_type!r}")
    fields = GRPOConfig.__dataclass_fields__
    for name in (
        "loss_type",
        "epsilon",
        "epsilon_high",
        "temperature",
        "importance_sampling_level",
        "steps_per_generation",
    ):
        if name not in fields:
            raise _moved(f"GRPOConfig.{name} is missing")


def aggregation_coefficient(
    loss_type: str, mask: torch.Tensor, max_completion_length: int, *, grad_accum: int = 1
) -> torch.Tensor:
    """Weight TRL 1.16's ``_compute_loss`` gives each token's masked loss in one micro-batch.

    ``dapo``/``cispo`` get 1 because ``num_items_in_batch`` is chosen to make their normalizer 1.
    """
    b = mask.size(0)
    if loss_type in ("grpo", "sapo"):
        per_row = mask.sum(-1, keepdim=True).clamp(min=1.0)
        return (1.0 / (per_row * b * grad_accum)).expand_as(mask)
    if loss_type == "bnpo":
        return torch.full_like(mask, 1.0 / (float(mask.sum().clamp(min=1.0)) * grad_accum))
    if loss_type == "dr_grpo":
        return torch.full_like(mask, 1.0 / (b * max_completion_length * grad_accum))
    if loss_type == "luspo":
        return torch.full_like(mask, 1.0 / (b * grad_accum))
    if loss_type in ("dapo", "cispo"):
        return torch.ones_like(mask)
    raise ValueError(f"loss_type {loss_type!r} does not multiply the importance-sampling factor")


def importance_gate(log_ratio: torch.Tensor, mode: str, clip: float) -> torch.Tensor:
    """TIS / masking factor per token from ``log(rho) = logp_theta - logp_behaviour`` (detached)."""
    if mode == "none":
        return torch.ones_like(log_ratio)
    rho = torch.exp(log_ratio)
    if mode == "tis":
        return torch.clamp(rho, max=clip) / rho
    if mode == "mask":
        return ((rho >= 1.0 / clip) & (rho <= clip)).to(log_ratio.dtype)
    raise ValueError(f"importance_sampling={mode!r} is not one of {IMPORTANCE_SAMPLING}")


def add_fused_head(model: PreTrainedModel, temperature: float) -> None:
    """TRL's fused log-prob head on a model TRL did not build (the KL reference), so that
    ``TrlLoss.logps`` scores it exactly like the policy."""
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(model, temperature=temperature)


def head_scales(config: PretrainedConfig) -> tuple[float | None, float]:
    """(final logit softcapping, logit scale) as TRL 1.16's ``add_fused_lm_head`` reads them."""
    text = config.get_text_config()
    softcap = getattr(text, "final_logit_softcapping", None)
    scale = getattr(text, "logit_scale", None)
    if scale is None:
        scale = getattr(text, "output_multiplier", None)
    if scale is None:
        scale = getattr(text, "lm_head_multiplier", None)
    if scale is None and getattr(text, "logits_scaling", None) is not None:
        scale = text.logits_scaling if text.model_type == "hyperclovax" else 1 / text.logits_scaling
    return softcap, 1.0 if scale is None else float(scale)


def token_logps(
    model: PreTrainedModel,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    *,
    cast_to_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs and entropies of ``targets`` (N,) given the final hidden states before them (N, H).

    TRL's chunked log-prob head (``ChunkedLogProbFunction``) with the temperature, logit scale and
    softcapping its ``add_fused_lm_head`` applies, so the values and gradients are those of the
    fused forward the padded path runs (``fineenvs.train.shared`` scores hidden states itself)."""
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    softcap, scale = head_scales(model.config)
    head = model.get_output_embeddings()
    ctx: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    if cast_to_fp32:
        hidden = hidden.float()
        ctx = torch.autocast(hidden.device.type, enabled=False)
    with ctx:
        out = ChunkedLogProbFunction.apply(
            hidden,
            head.weight,
            head.bias,
            targets,
            temperature,
            _CHUNKED_LOGPROB_CHUNK_SIZE,
            softcap,
            scale,
            ("log_probs", "entropy"),
        )
    return out[0], out[1]


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, this micro-batch's share of the step loss
    logps: torch.Tensor  # (B, C) trainer logprobs, detached
    logps_graph: torch.Tensor  # the same, attached to the autograd graph
    entropies: torch.Tensor | None  # (B, C)
    gate: torch.Tensor  # (B, C) importance-sampling factor applied


def _never_called(*_: object, **__: object) -> NoReturn:
    raise RuntimeError(
        "CapturedGRPOTrainer never generates or scores completions: rows come from the capture proxy. "
        "Something called TRL's generation path; use CapturedGRPOTrainer.step(rows)."
    )


class _NoWeightSync:
    """Stands in for ``vllm_generation``: weight pushes are the caller's (``on_weights_updated``)."""

    def sync_weights(self) -> None:
        return None


_LogpsAndEntropies = tuple[torch.Tensor, torch.Tensor | None, object]
"""What TRL's ``_get_per_token_logps_and_entropies`` returns: logprobs, entropies, and an extra."""


class TrlLoss:
    """A ``GRPOTrainer`` used only for its loss, optimizer and scheduler."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        output_dir: Path,
        loss_type: str,
        epsilon: float,
        epsilon_high: float | None,
        temperature: float,
        importance_sampling_level: str,
        max_completion_length: int,
        learning_rate: float,
        lr_scheduler_type: str,
        warmup_steps: int,
        max_steps: int,
        weight_decay: float,
        optim: str,
        max_grad_norm: float,
        seed: int,
        use_cpu: bool,
        process_timeout_s: int = 1800,
    ) -> None:
        check_trl_internals()
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        from datasets import Dataset
        from trl.trainer.grpo_config import GRPOConfig
        from trl.trainer.grpo_trainer import GRPOTrainer

        self.loss_type = loss_type
        self.max_completion_length = max_completion_length
        args = GRPOConfig(
            output_dir=str(output_dir),
            per_device_train_batch_size=2,
            num_generations=2,
            max_completion_length=max_completion_length,
            loss_type=loss_type,
            epsilon=epsilon,
            epsilon_high=epsilon_high,
            beta=0.0,  # applied by the caller (see module docstring)
            temperature=temperature,
            importance_sampling_level=importance_sampling_level,
            learning_rate=learning_rate,
            lr_scheduler_type=lr_scheduler_type,
            warmup_steps=warmup_steps,
            max_steps=max_steps,
            weight_decay=weight_decay,
            optim=optim,
            max_grad_norm=max_grad_norm,
            seed=seed,
            use_cpu=use_cpu,
            ddp_timeout=process_timeout_s,
            bf16=False,  # fineenvs.train.grpo autocasts itself, over float32 weights
            fp16=False,
            gradient_checkpointing=False,  # the caller enables it on the model
            disable_dropout=True,
            report_to="none",
            logging_strategy="no",
            save_strategy="no",
        )
        self.trainer: Any = GRPOTrainer(
            model=model,
            reward_funcs=[_never_called],
            args=args,
            train_dataset=Dataset.from_dict({"prompt": ["unused", "unused"]}),
            processing_class=tokenizer,
            rollout_func=_never_called,
        )
        t: Any = self.trainer  # TRL's private attributes, set for the shim below
        # The use_vllm shim: lets _compute_loss apply our importance_sampling_ratio tensor.
        t.use_vllm = True
        t.vllm_mode = "server"
        t.vllm_importance_sampling_correction = True
        t.vllm_generation = _NoWeightSync()
        t._last_loaded_step = -1
        # We accumulate ourselves; TRL's per-window division must be a no-op.
        t.current_gradient_accumulation_steps = 1
        self._original_logps_fn: Callable[..., _LogpsAndEntropies] = t._get_per_token_logps_and_entropies

    @property
    def accelerator(self) -> Accelerator:
        return self.trainer.accelerator

    def create_optimizer_and_scheduler(
        self, num_training_steps: int
    ) -> tuple[torch.optim.Optimizer, LRScheduler]:
        self.trainer.create_optimizer_and_scheduler(num_training_steps=num_training_steps)
        return self.trainer.optimizer, self.trainer.lr_scheduler

    def logps(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        """Trainer logprobs of the completion tokens (temperature-scaled), with gradient."""
        input_ids = torch.cat([mb.prompt_ids, mb.completion_ids], dim=1)
        attention = torch.cat([torch.ones_like(mb.prompt_ids), mb.attention], dim=1)
        out = self._original_logps_fn(model, input_ids, attention, mb.completion_ids.size(1))
        logps: torch.Tensor = out[0]
        return logps

    @property
    def cast_lm_head_to_fp32(self) -> bool:
        return bool(getattr(self.trainer.args, "cast_lm_head_to_fp32", False))

    def __call__(
        self,
        model: torch.nn.Module,
        mb: MicroBatch,
        *,
        importance_sampling: str,
        clip: float,
        num_tokens_total: float,
        precomputed: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    ) -> LossOutput:
        """TRL's loss on ``mb``. ``precomputed`` = (logprobs, entropies) of the completion tokens,
        (B, C) with their graph, computed elsewhere (the prefix-shared forward): TRL then runs
        no forward of its own and its loss is taken on these."""
        t = self.trainer
        num_processes = t.accelerator.num_processes
        spg = t.args.steps_per_generation
        if self.loss_type == "vespo":
            # Its normalizer is sum(masked loss) / (num_items / num_processes * spg^-1); weights
            # are uniform (per_token only), so num_items makes it divide by the step's token count.
            num_items = num_tokens_total * num_processes * spg
        else:
            num_items = float(num_processes * spg)
        inputs: dict[str, torch.Tensor] = {
            "prompt_ids": mb.prompt_ids,
            "prompt_mask": torch.ones_like(mb.prompt_ids),
            "completion_ids": mb.completion_ids,
            "completion_mask": mb.attention,
            "tool_mask": mb.loss_mask.to(mb.attention.dtype),
            "old_per_token_logps": mb.behaviour_logps,
            "advantages": mb.advantages,
            "num_items_in_batch": torch.tensor(num_items, device=mb.advantages.device),
        }
        captured: dict[str, torch.Tensor | None] = {}
        mask = mb.loss_mask

        def logps_and_fill_ratio(*args: object, **kwargs: object) -> _LogpsAndEntropies:
            if precomputed is None:
                logps, entropies, aux = self._original_logps_fn(*args, **kwargs)
            else:
                (logps, entropies), aux = precomputed, None
            with torch.no_grad():
                gate = importance_gate(logps.detach() - mb.behaviour_logps, importance_sampling, clip) * mask
                if self.loss_type == "vespo":
                    factor = torch.where(mask > 0, gate, torch.ones_like(gate))
                else:
                    coef = aggregation_coefficient(self.loss_type, mask, self.max_completion_length)
                    factor = gate * mb.weights / coef
            inputs["importance_sampling_ratio"] = factor
            captured["logps"], captured["entropies"], captured["gate"] = logps, entropies, gate
            return logps, entropies, aux

        t._get_per_token_logps_and_entropies = logps_and_fill_ratio
        try:
            loss = t._compute_loss(model, inputs)
        finally:
            del t._get_per_token_logps_and_entropies  # back to the class method
            t._metrics["train"].clear()  # TRL's own per-call metrics; ours are computed by the caller
            t._metrics["eval"].clear()
        logps, gate = captured["logps"], captured["gate"]
        if logps is None or gate is None:
            raise _moved("GRPOTrainer._compute_loss did not call _get_per_token_logps_and_entropies")
        entropies = captured["entropies"]
        return LossOutput(
            loss=loss,
            logps=logps.detach(),
            logps_graph=logps,
            entropies=None if entropies is None else entropies.detach(),
            gate=gate,
        )
