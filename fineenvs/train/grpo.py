"""GRPO on captured rows: one optimizer step per call, over rows the capture proxy recorded.

The trainer consumes token ids and behaviour logprobs, never text: nothing is re-tokenized or
re-rendered. ``CapturedGRPOTrainer.step(rows)`` takes one optimizer step over ``rows``, split into
micro-batches internally; every row of every attempt trains, each with its attempt's advantage.

Loss. TRL 1.16's ``GRPOTrainer._compute_loss`` computes the per-token objective (``loss_type``,
PPO clipping with ``epsilon``/``epsilon_high``, ``importance_sampling_level``), with the
engine's logprobs as pi_old as in TRL's AsyncGRPO; ``trl_compat`` holds every TRL-internal touch
and explains how. Normalisation (``batching``) is decided over the whole step, so the loss is the
same however the rows are split into micro-batches (TRL #7249): ``per_token`` (published),
``per_attempt`` (each attempt weighs the same whatever its row count), ``per_row``, or
``loss_type`` (TRL's aggregation for that loss type, over the whole step).

Off-policy. Every step logs ``train/ratio`` (mean, min, max of exp(trainer logprob - behaviour
logprob) over trained tokens) with logits divided by ``temperature``, which must be the engine's
sampling temperature. On-policy in float32 it is 1 within 1e-4 (tested against the embedded
engine's sampling loop; measured on 8 two-turn rows, 286 tokens, T in {1.0, 0.7}: |mean - 1| <=
6.3e-7 and every token's ratio within [0.99996, 1.00003] for tiny_qwen, tiny_lfm2 and
tiny_qwen3_5). ``importance_sampling="tis"`` truncates the importance weight at
``importance_sampling_clip`` C, ``"mask"`` drops tokens whose ratio leaves [1/C, C]; both off by
default, as published (staleness is bounded by the scheduler instead). ``beta`` > 0 adds TRL's
KL estimator ``exp(ref - logp) - (ref - logp) - 1`` (times the ratio, TRL's
``use_bias_correction_kl``) against the initial weights, weighted like the policy term.

Prefix sharing (``prefix_sharing``). ``padded``: every row is forwarded from its first token,
right-padded in micro-batches of ``per_device_batch_size`` rows (``batching``), so a prefix held by ``k``
rows is computed ``k`` times. ``shared``: the step's rows become a token-prefix tree
(``prefix_tree``: an attempt's forked calls, a group's prompt) and each node is forwarded and
backpropagated once, its children continuing from its state through transformers' cache objects
(attention keys and values, LFM2's convolution state, Qwen3.5's convolution and recurrent state;
``shared``); TRL's loss is then taken on each row's logprobs exactly as on a padded micro-batch,
so the loss, normalisation and weights are the padded path's (gradients equal to 1e-5, tested for
the three tiny architectures). ``per_device_batch_size`` does not apply there. Under several processes
the step takes the padded path (data-parallel backends need the same forward passes on every
process), with a warning. Neither path packs rows into one sequence, so LFM2's short convolutions
and Qwen3.5's linear attention never scan across rows. TRL's ``AsyncGRPOTrainer`` packs shared
prefixes for attention layers only: it refuses both hybrids, asserts CUDA and fetches an FA3
kernel from the Hub (measured: ``trl_compat``).

Precision. The weights, gradients and AdamW state are always float32 (16 bytes per parameter);
``dtype="bfloat16"`` runs the forward passes under ``torch.autocast`` in bfloat16, as TRL's
AsyncGRPO does. Plain bf16 weights would lose the updates: AdamW moves each weight by about
``lr`` per step, and bf16 keeps 8 significant bits, so at the published lr 3e-6 every weight with
``|w| > 256 * lr`` (about 8e-4: most weights of a real model) rounds back to where it was
(tested in ``tests/train/test_precision.py``).

Weights. ``state_dict(dtype)`` returns the full state dict (gathered under FSDP), cast to the
engine's dtype, for ``fineenvs.engine.weights.WeightSync.push`` (NCCL broadcasts it; reload and the
embedded engine stage it as a safetensors directory); ``export_weights(dir, dtype)`` writes that
directory itself. ``on_weights_updated`` is called after every ``weight_sync_interval`` optimizer
steps with the trainer, so the caller pushes.
``policy_version`` counts optimizer steps since the initial weights.
Under several processes the callback runs on every process: call ``state_dict()`` on all of them
(it gathers FSDP shards) and push from ``trainer.accelerator.is_main_process`` only.

Checkpoints. ``save_checkpoint(dir)`` writes the model and tokenizer in Hugging Face layout (the
engine reloads them), ``optimizer.pt``, ``scheduler.pt``, ``rng_state.pt`` and
``trainer_state.json`` (step, policy version, settings); ``load_checkpoint(dir)`` restores all of
it, so the next step is the one an uninterrupted run would take.

More than one device (``accelerate launch``). Configs ship in ``fineenvs/train/accelerate/``:

- ``single_gpu.yaml``, the published layout: the trainer on GPU 0, vLLM on GPU 1 (start vLLM with
  ``CUDA_VISIBLE_DEVICES=1``, the trainer with ``CUDA_VISIBLE_DEVICES=0``):
  ``accelerate launch --config_file fineenvs/train/accelerate/single_gpu.yaml -m fineenvs.run ...``
- ``fsdp_multi_gpu.yaml``: FSDP2 over 4 training GPUs (full shard), vLLM on the others.
  Change ``num_processes`` to the training GPU count.

Under ``accelerate`` every process must call ``step`` with the same rows: micro-batches are dealt
round-robin across processes, the normalisation weights are global, and every process runs the
same number of full-size micro-batches (short ones padded with zero-weight copies of a row) so
TRL's collective metric calls stay in lockstep. The loss is multiplied
by the process count because data-parallel backends average gradients.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from fineenvs.jsonl import JsonObject
from fineenvs.train.batching import (
    MicroBatch,
    build_micro_batch,
    plan_micro_batches,
    resolve_normalisation,
    token_weights,
)
from fineenvs.train.grpo_config import CLIPPED_LOSS_TYPES, TRL_VERSION, GRPOSettings
from fineenvs.train.prefix_tree import Node, PrefixTree, build_tree
from fineenvs.train.shared import SharedForward, all_positions, trained_positions
from fineenvs.train.train_rows import TrainRow
from fineenvs.train.trl_compat import LossOutput, TrlLoss, add_fused_head, token_logps

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
log = logging.getLogger(__name__)


@dataclass
class _Tally:
    """Sums over the micro-batches (or tree nodes) of one step, for its metrics."""

    loss: float = 0.0
    ratio_sum: float = 0.0
    ratio_min: float = math.inf
    ratio_max: float = -math.inf
    n_tok: int = 0
    clipped: float = 0.0
    gated_out: float = 0.0
    truncated: float = 0.0
    entropy_sum: float = 0.0

    def add(self, trainer: CapturedGRPOTrainer, out: LossOutput, mb: MicroBatch, real: int) -> None:
        """``out`` is TRL's loss output on ``mb``, whose first ``real`` rows are real (the rest
        zero-weight padding for lockstep)."""
        self.loss += float(out.loss.detach())
        if real == 0:
            return
        m = mb.loss_mask > 0
        m[real:] = False
        ratio = torch.exp((out.logps - mb.behaviour_logps)[m])
        self.ratio_sum += float(ratio.sum())
        self.ratio_min = min(self.ratio_min, float(ratio.min()))
        self.ratio_max = max(self.ratio_max, float(ratio.max()))
        self.n_tok += int(m.sum())
        self.clipped += float(trainer._clipped(out.logps, mb)[m].sum())
        gate = out.gate[m]
        self.gated_out += float((gate == 0).sum())
        self.truncated += float(((gate > 0) & (gate < 1)).sum())
        if out.entropies is not None:
            self.entropy_sum += float(out.entropies[m].sum())


class CapturedGRPOTrainer:
    """GRPO on captured rows (see the module docstring).

    ``settings`` is kept by reference. Read at every step: ``prefix_sharing``, ``per_device_batch_size``,
    ``normalisation``, ``importance_sampling``, ``importance_sampling_clip``, ``token_budget``,
    ``max_completion_length``, ``weight_sync_interval``, ``max_grad_norm``, and ``beta`` (which
    can only be turned off later, the reference model being loaded at construction). The loss
    type, clipping, temperature, optimizer and schedule are fixed at construction.
    """

    settings: GRPOSettings
    tokenizer: PreTrainedTokenizerBase

    def __init__(
        self,
        model_dir: Path,
        settings: GRPOSettings,
        output_dir: Path,
        *,
        on_weights_updated: Callable[[CapturedGRPOTrainer], None] | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers import set_seed as hf_set_seed

        settings.check()
        self.settings = settings
        self.model_dir = Path(model_dir)
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.on_weights_updated = on_weights_updated
        hf_set_seed(settings.seed)
        # Master weights stay float32 whatever settings.dtype says (module docstring, "Precision").
        self.compute_dtype = DTYPES[settings.dtype]
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        model.config.use_cache = False
        if settings.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id
        if pad is None:
            raise ValueError(
                f"The tokenizer in {self.model_dir} has neither a pad nor an eos token to pad with"
            )
        self.pad_token_id = int(pad)
        self._trl = TrlLoss(
            model,
            self.tokenizer,
            output_dir=self.output_dir / "trl",
            loss_type=settings.loss_type,
            epsilon=settings.epsilon,
            epsilon_high=settings.epsilon_high,
            temperature=settings.temperature,
            importance_sampling_level=settings.importance_sampling_level,
            max_completion_length=settings.max_completion_length,
            learning_rate=settings.learning_rate,
            lr_scheduler_type=settings.lr_scheduler_type,
            warmup_steps=settings.warmup_steps,
            max_steps=settings.max_steps,
            weight_decay=settings.weight_decay,
            optim=settings.optim,
            max_grad_norm=settings.max_grad_norm,
            seed=settings.seed,
            use_cpu=not torch.cuda.is_available(),
            process_timeout_s=settings.process_timeout_s,
        )
        self.accelerator = self._trl.accelerator
        optimizer, scheduler = self._trl.create_optimizer_and_scheduler(settings.max_steps)
        self.model, self.optimizer, self.lr_scheduler = self.accelerator.prepare(model, optimizer, scheduler)
        self.ref_model: PreTrainedModel | None = None
        if settings.beta > 0.0:
            # Frozen: it needs no float32 master copy, the compute dtype halves its memory.
            self.ref_model = self._load_reference(self.compute_dtype)
        self.global_step = 0
        self._version = 0
        self._runners: dict[str, SharedForward] = {}
        self._warned_shared = False

    # -- public state ----------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        """Version of the current weights: optimizer steps taken since the initial weights."""
        return self._version

    @property
    def unwrapped_model(self) -> PreTrainedModel:
        # accelerate unwraps to the model it was given, a transformers model
        return cast("PreTrainedModel", self.accelerator.unwrap_model(self.model))

    def state_dict(
        self, dtype: torch.dtype | str | None = None, checkpoint_format: bool = False
    ) -> dict[str, torch.Tensor]:
        """Full state dict with Hugging Face parameter names (gathered under FSDP: every process
        must call it), floating tensors cast to ``dtype`` (the engine's; None keeps float32).

        ``checkpoint_format`` names the tensors as the model's checkpoint files do (transformers'
        ``revert_weight_conversion``, what ``save_pretrained`` writes): vLLM loads pushed weights
        by checkpoint names and only warns about names it does not know, so in-memory names that
        a model renames on load would make a push change nothing."""
        sd: dict[str, torch.Tensor] = self.accelerator.get_state_dict(self.model)
        if checkpoint_format:
            try:
                from transformers.core_model_loading import revert_weight_conversion
            except ImportError:  # transformers without load-time renaming: names are the files'
                pass
            else:
                sd = revert_weight_conversion(self.unwrapped_model, sd)
            if getattr(self.unwrapped_model.config, "tie_word_embeddings", False):
                sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}  # not in the files either
        target = DTYPES[dtype] if isinstance(dtype, str) else dtype
        if target is None:
            return sd
        return {k: v.to(target) if v.is_floating_point() and v.dtype != target else v for k, v in sd.items()}

    def autocast(self) -> contextlib.AbstractContextManager[object]:
        """Mixed precision for the forward passes (no-op in float32)."""
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.accelerator.device.type, dtype=self.compute_dtype)

    # -- training --------------------------------------------------------------------------

    def step(self, rows: Sequence[TrainRow]) -> dict[str, float]:
        """One optimizer step over ``rows``; returns this step's metrics."""
        start = time.perf_counter()
        s = self.settings
        metrics = self.loss_and_gradients(rows)
        if s.max_grad_norm > 0:
            grad_norm = self.accelerator.clip_grad_norm_(self.model.parameters(), s.max_grad_norm)
        else:
            grads = [p.grad.detach().norm() for p in self.model.parameters() if p.grad is not None]
            grad_norm = torch.stack(grads).norm() if grads else torch.tensor(0.0)
        lr = float(self.lr_scheduler.get_last_lr()[0])
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        self._version += 1
        elapsed = time.perf_counter() - start
        metrics.update(
            {
                "train/grad_norm": float(grad_norm),
                "train/learning_rate": lr,
                "train/tokens_per_s": metrics["train/tokens"] / elapsed if elapsed > 0 else 0.0,
                "train/step": float(self.global_step),
                "train/policy_version": float(self._version),
                "train/step_seconds": elapsed,
            }
        )
        if self.on_weights_updated is not None and self.global_step % s.weight_sync_interval == 0:
            self.on_weights_updated(self)
        return metrics

    def loss_and_gradients(self, rows: Sequence[TrainRow]) -> dict[str, float]:
        """Forward and backward over ``rows`` (gradients left in ``.grad``, no optimizer step).

        ``step`` is this plus clipping and the optimizer update; tests and diagnostics call it to
        inspect the gradient of a batch.
        """
        s = self.settings
        kept = self._trainable_rows(rows)
        rule = resolve_normalisation(s.normalisation, s.loss_type)
        weights = token_weights(kept, rule, s.max_completion_length)
        weight_total = float(sum(sum(r.weights()) for r in kept))

        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        if self._shares_prefixes():
            tally, passes, forwarded, unique = self._shared_pass(kept, weights, weight_total)
        else:
            tally, passes, forwarded = self._padded_pass(kept, weights, weight_total)
            unique = build_tree([r.input_ids for r in kept]).unique_tokens
        return self._step_metrics(
            kept, tally, passes=passes, forwarded=forwarded, unique=unique, over_budget=len(rows) - len(kept)
        )

    def _trainable_rows(self, rows: Sequence[TrainRow]) -> list[TrainRow]:
        """The rows within ``token_budget``, after refusing a batch this trainer cannot train."""
        s = self.settings
        if not rows:
            raise ValueError(
                "step() needs at least one row; skip the step when a batch has no trainable rows"
            )
        for i, r in enumerate(rows):
            r.check(f"row {i}")
        advantage_of: dict[str, float] = {}
        for r in rows:
            if advantage_of.setdefault(r.attempt_id, r.advantage) != r.advantage:
                raise ValueError(
                    f"attempt {r.attempt_id!r} has rows with advantages {advantage_of[r.attempt_id]} and "
                    f"{r.advantage}: the advantage is attempt-level, stamp every row of an attempt with it"
                )
        kept = [r for r in rows if len(r.input_ids) <= s.token_budget]
        if not kept:
            raise ValueError(
                f"all {len(rows)} rows are longer than token_budget={s.token_budget}; raise token_budget "
                "or cut rows when building them (trajectory RowOptions.max_tokens)"
            )
        if s.loss_type == "vespo" and any(r.loss_weight is not None for r in kept):
            raise ValueError("loss_type='vespo' cannot apply per-token loss_weight; build rows without it")
        embeddings = cast(torch.Tensor, self.unwrapped_model.get_input_embeddings().weight)
        vocab = int(embeddings.shape[0])
        top = max(max(r.input_ids) for r in kept)
        if top >= vocab or min(min(r.input_ids) for r in kept) < 0:
            raise ValueError(
                f"a row holds token id {top}, outside the model's vocabulary of {vocab} ({self.model_dir}): "
                "rows must be captured from an engine serving this model's tokenizer"
            )
        return kept

    def _step_metrics(
        self,
        kept: list[TrainRow],
        tally: _Tally,
        *,
        passes: int,
        forwarded: int,
        unique: int,
        over_budget: int,
    ) -> dict[str, float]:
        """The step's ``train/*`` metrics, summed over processes (a collective: every process calls it)."""
        totals = self._reduce(
            [
                tally.loss,
                tally.ratio_sum,
                float(tally.n_tok),
                tally.clipped,
                tally.gated_out,
                tally.truncated,
                tally.entropy_sum,
                float(forwarded),
            ]
        )
        loss_total, ratio_sum, n_tok_f, clipped, gated_out, truncated, entropy_sum, forwarded_f = totals
        n_tok_f = max(n_tok_f, 1.0)
        staleness = [self._version - r.policy_version for r in kept]
        return {
            "train/loss": loss_total,
            "train/ratio": ratio_sum / n_tok_f,
            "train/ratio_min": self._reduce_extreme(tally.ratio_min, "min"),
            "train/ratio_max": self._reduce_extreme(tally.ratio_max, "max"),
            "train/clip_fraction": clipped / n_tok_f,
            "train/is_masked_fraction": gated_out / n_tok_f,
            "train/is_truncated_fraction": truncated / n_tok_f,
            "train/entropy": entropy_sum / n_tok_f,
            "train/tokens_trained": float(sum(sum(r.loss_mask) for r in kept)),
            "train/tokens": float(sum(len(r.input_ids) for r in kept)),
            "train/tokens_unique": float(unique),
            "train/tokens_forwarded": forwarded_f,
            "train/rows": float(len(kept)),
            "train/rows_over_budget": float(over_budget),
            "train/attempts": float(len({r.attempt_id for r in kept})),
            "train/groups": float(len({r.group_id for r in kept})),
            "train/micro_batches": float(passes),
            "train/advantage_mean": sum(r.advantage for r in kept) / len(kept),
            "train/staleness_mean": sum(staleness) / len(staleness),
            "train/staleness_max": float(max(staleness)),
        }

    def _shares_prefixes(self) -> bool:
        if self.settings.prefix_sharing != "shared":
            return False
        if self.accelerator.num_processes > 1:
            if not self._warned_shared:
                log.warning(
                    "trainer.prefix_sharing=shared runs in one process; under %d processes each "
                    "process would run a different number of forward passes, which data-parallel "
                    "backends must match, so this run trains on the padded path",
                    self.accelerator.num_processes,
                )
                self._warned_shared = True
            return False
        return True

    def _padded_pass(
        self, kept: list[TrainRow], weights: list[list[float]], weight_total: float
    ) -> tuple[_Tally, int, int]:
        """Every row forwarded alone, in right-padded micro-batches; returns the tally, the number
        of micro-batches and the tokens forwarded (padding included)."""
        s = self.settings
        plan = plan_micro_batches(kept, s.per_device_batch_size)
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        local = plan[rank::world]
        n_local = math.ceil(len(plan) / world)
        device = self.accelerator.device
        tally = _Tally()
        forwarded = 0
        for k in range(n_local):
            indices = local[k] if k < len(local) else []
            real = len(indices)
            if world > 1:
                # TRL gathers per-row metrics across processes inside _compute_loss, so every
                # process must pass the same number of rows: pad with zero-weight copies.
                indices = indices + [plan[0][0]] * (s.per_device_batch_size - real)
            mb = build_micro_batch(kept, indices, weights, self.pad_token_id, device)
            mb.weights[real:] = 0.0
            forwarded += mb.size * (mb.prompt_ids.size(1) + mb.completion_ids.size(1))
            with self.autocast():
                out = self._micro_batch_loss(mb, weight_total)
            self.accelerator.backward(out.loss * world)
            tally.add(self, out, mb, real)
        return tally, len(plan), forwarded

    def _shared_pass(
        self, kept: list[TrainRow], weights: list[list[float]], weight_total: float
    ) -> tuple[_Tally, int, int, int]:
        """Each shared prefix forwarded and backpropagated once (``fineenvs.train.shared``); the
        rows ending at a node are scored by TRL's loss exactly as a micro-batch of theirs would be.
        Returns the tally, forward passes, tokens forwarded and unique tokens."""
        runner = self._shared_runner()
        seqs = [r.input_ids for r in kept]
        tree = build_tree(seqs, one_token_inner=runner.one_token_inner)
        needed = trained_positions([np.asarray(r.loss_mask, dtype=bool) for r in kept])
        ref = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref = self._tree_logps(self._shared_runner(reference=True), tree, seqs, needed)
        device = self.accelerator.device
        tally = _Tally()

        def on_rows(node: Node, lps: list[torch.Tensor], ents: list[torch.Tensor]) -> torch.Tensor:
            mb = build_micro_batch(kept, node.ends, weights, self.pad_token_id, device)
            split, b = mb.prompt_ids.size(1), mb.size
            # Rows ending at one node are identical: one logprob row, seen by each of them.
            logps = torch.cat(lps)[split:].unsqueeze(0).expand(b, -1)
            entropies = torch.cat(ents)[split:].unsqueeze(0).expand(b, -1)
            ref_mb = None if ref is None else torch.stack([ref[i][split:] for i in node.ends])
            out = self._micro_batch_loss(mb, weight_total, precomputed=(logps, entropies), ref=ref_mb)
            tally.add(self, out, mb, b)
            loss: torch.Tensor = out.loss
            return loss

        stats = runner.run(tree, seqs, needed=needed, on_rows=on_rows, train=True)
        return tally, stats.forward_passes, stats.tokens_forwarded, tree.unique_tokens

    def _shared_runner(self, reference: bool = False) -> SharedForward:
        key = "reference" if reference else "policy"
        runner = self._runners.get(key)
        if runner is None:
            model = self.unwrapped_model
            if reference:
                if self.ref_model is None:
                    raise RuntimeError("the reference model is loaded only with trainer.beta > 0")
                model = self.ref_model
            s = self.settings
            cast = self._trl.cast_lm_head_to_fp32

            def score(
                hidden: torch.Tensor, targets: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
                return token_logps(model, hidden, targets, s.temperature, cast_to_fp32=cast)

            runner = SharedForward(model, score=score, pad_token_id=self.pad_token_id, autocast=self.autocast)
            self._runners[key] = runner
        return runner

    @staticmethod
    def _tree_logps(
        runner: SharedForward,
        tree: PrefixTree,
        seqs: Sequence[Sequence[int]],
        needed: Callable[[Node], np.ndarray],
    ) -> dict[int, torch.Tensor]:
        """Each row's logprob of every token in ``needed`` positions (0.0 elsewhere), detached."""
        out: dict[int, torch.Tensor] = {}

        def keep(node: Node, lps: list[torch.Tensor], _: list[torch.Tensor]) -> None:
            full = torch.cat(lps).detach()
            for i in node.ends:
                out[i] = full

        runner.run(tree, seqs, needed=needed, on_rows=keep, train=False)
        return out

    @torch.no_grad()
    def sequence_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """log p(token | the tokens before it) at temperature 1 for every token after the first of
        each sequence, under the training forward's autocast: what the engine-trainer parity gate
        (``fineenvs.engine.parity``) compares with the engine's ``prompt_logprobs``. A collective
        under FSDP (every process calls it)."""
        was_training = self.model.training
        self.model.eval()
        out: list[list[float]] = []
        try:
            for seq in sequences:
                ids = torch.tensor([list(seq)], dtype=torch.long, device=self.accelerator.device)
                with self.autocast():
                    logits = self.model(input_ids=ids, use_cache=False).logits[0, :-1].float()
                logprobs = torch.log_softmax(logits, dim=-1)
                targets = ids[0, 1:].unsqueeze(-1)
                out.append(logprobs.gather(-1, targets).squeeze(-1).cpu().tolist())
        finally:
            self.model.train(was_training)
        return out

    @torch.no_grad()
    def token_logprobs(self, rows: Sequence[TrainRow]) -> list[list[float]]:
        """The trainer's logprob of every token given its prefix (0.0 for the first token),
        temperature-scaled like the loss; aligned with each row's ``input_ids``."""
        if self._shares_prefixes() and rows:
            runner = self._shared_runner()
            seqs = [r.input_ids for r in rows]
            tree = build_tree(seqs, one_token_inner=runner.one_token_inner)
            scored = self._tree_logps(runner, tree, seqs, all_positions)
            return [scored[i].float().cpu().tolist() for i in range(len(rows))]
        out: list[list[float]] = []
        device = self.accelerator.device
        for row in rows:
            ids = torch.tensor([row.input_ids], dtype=torch.long, device=device)
            n = ids.size(1)
            # Every token from the second on is scored: a one-token prompt, the rest as completion.
            mb = MicroBatch(
                row_indices=[0],
                prompt_ids=ids[:, :1],
                completion_ids=ids[:, 1:],
                attention=torch.ones((1, n - 1), dtype=torch.long, device=device),
                loss_mask=torch.ones((1, n - 1), device=device),
                weights=torch.zeros((1, n - 1), device=device),
                behaviour_logps=torch.zeros((1, n - 1), device=device),
                advantages=torch.zeros(1, device=device),
                tokens=n,
            )
            with self.autocast():
                row_logps: list[float] = self._trl.logps(self.model, mb)[0].float().cpu().tolist()
            out.append([0.0, *row_logps])
        return out

    def _micro_batch_loss(
        self,
        mb: MicroBatch,
        weight_total: float,
        *,
        precomputed: tuple[torch.Tensor, torch.Tensor | None] | None = None,
        ref: torch.Tensor | None = None,
    ) -> LossOutput:
        s = self.settings
        out = self._trl(
            self.model,
            mb,
            importance_sampling=s.importance_sampling,
            clip=s.importance_sampling_clip,
            num_tokens_total=weight_total,
            precomputed=precomputed,
        )
        if self.ref_model is not None:
            if ref is None:
                with torch.no_grad():
                    ref = self._trl.logps(self.ref_model, mb)
            logps = out.logps_graph  # same forward as the policy term, with its graph
            diff = ref - logps
            kl = torch.exp(diff) - diff - 1.0
            kl = kl * torch.exp(logps - mb.behaviour_logps)  # TRL's use_bias_correction_kl
            out.loss = out.loss + s.beta * (kl * mb.weights * out.gate).sum()
        return out

    def _clipped(self, logps: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """1 where TRL's clipping is active for the token (its ``clip_ratio/region_mean``)."""
        s = self.settings
        log_ratio = logps - mb.behaviour_logps
        if s.importance_sampling_level == "sequence":  # GSPO clips the sequence's mean log-ratio
            mask = mb.loss_mask
            seq = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
            log_ratio = seq.expand_as(log_ratio)
        ratio = torch.exp(log_ratio)
        adv = mb.advantages.unsqueeze(1)
        eps_high = s.epsilon_high if s.epsilon_high is not None else s.epsilon
        if s.loss_type in CLIPPED_LOSS_TYPES:
            hit = ((ratio < 1 - s.epsilon) & (adv < 0)) | ((ratio > 1 + eps_high) & (adv > 0))
        elif s.loss_type == "cispo":
            hit = (ratio > eps_high) & (adv > 0)
        else:
            hit = torch.zeros_like(ratio, dtype=torch.bool)
        return hit.float()

    def _reduce(self, values: list[float]) -> list[float]:
        if self.accelerator.num_processes == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.accelerator.device)
        out: list[float] = self.accelerator.reduce(t, reduction="sum").tolist()
        return out

    def _reduce_extreme(self, value: float, how: str) -> float:
        if self.accelerator.num_processes == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.accelerator.device)
        gathered = self.accelerator.gather(t)
        return float(gathered.min() if how == "min" else gathered.max())

    def _load_reference(self, dtype: torch.dtype) -> PreTrainedModel:
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype)
        add_fused_head(ref, self.settings.temperature)
        ref.requires_grad_(False)
        model: PreTrainedModel = ref.to(self.accelerator.device).eval()
        return model

    # -- weights and checkpoints -----------------------------------------------------------

    def export_weights(self, directory: Path, dtype: torch.dtype | str | None = None) -> Path:
        """Write the current weights (cast to ``dtype``) as ``directory/model.safetensors``; returns
        the directory, which is what engines reload from. A collective under FSDP: every process
        calls it, the main process writes."""
        from fineenvs.engine.weights import save_safetensors

        directory = Path(directory)
        if directory.suffix == ".safetensors":
            raise ValueError(
                f"export_weights writes a directory (model.safetensors inside), got the file {directory}: "
                f"pass {directory.parent} (engines reload weights from a directory)"
            )
        state = self.state_dict(dtype)
        if self.accelerator.is_main_process:
            save_safetensors(state, directory)
        self.accelerator.wait_for_everyone()
        return directory

    def save_checkpoint(self, directory: Path) -> Path:
        from fineenvs.train.checkpoint import save_checkpoint

        return save_checkpoint(self, Path(directory))

    def load_checkpoint(self, directory: Path) -> None:
        from fineenvs.train.checkpoint import load_checkpoint

        load_checkpoint(self, Path(directory))

    def trainer_state(self) -> JsonObject:
        return {
            "global_step": self.global_step,
            "policy_version": self._version,
            "settings": dataclasses.asdict(self.settings),
            "model_dir": str(self.model_dir),
            "trl_version": TRL_VERSION,
        }

    def restore_trainer_state(self, state: JsonObject) -> None:
        self.global_step = int(state["global_step"])
        self._version = int(state["policy_version"])
