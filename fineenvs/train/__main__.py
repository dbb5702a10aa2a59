"""A few GRPO steps on a tiny model with synthetic on-policy rows; prints one JSON line per step.

    python -m fineenvs.train --model tiny_lfm2 --steps 3
    accelerate launch --config_file fineenvs/train/accelerate/single_gpu.yaml --cpu -m fineenvs.train

Checks the trainer end to end (including under ``accelerate launch``) without an engine: the
rows' behaviour logprobs are the trainer's own, so ``train/ratio`` is 1 at the first step. The
last line (main process) is ``{"final": ...}`` with a checksum of the weights, which must not
depend on the number of processes.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

from fineenvs.train.grpo import CapturedGRPOTrainer
from fineenvs.train.grpo_config import GRPOSettings
from fineenvs.train.train_rows import TrainRow


def synthetic_rows(trainer: CapturedGRPOTrainer, seed: int, attempts: int, version: int) -> list[TrainRow]:
    rng = random.Random(seed)
    drafts = []
    for a in range(attempts):
        for _ in range(1 + a % 3):  # attempts with 1, 2 or 3 rows
            n_ctx, n_out = 4 + rng.randrange(6), 6 + rng.randrange(10)
            ids = [rng.randrange(20, 900) for _ in range(n_ctx + n_out)]
            mask = [0] * n_ctx + [1] * n_out
            drafts.append(
                TrainRow(ids, mask, [0.0] * len(ids), a - (attempts - 1) / 2, f"a{a}", "g", version)
            )
    logps = trainer.token_logprobs(drafts)
    return [
        TrainRow(
            d.input_ids,
            d.loss_mask,
            [lp if m else 0.0 for lp, m in zip(lp_row, d.loss_mask, strict=True)],
            d.advantage,
            d.attempt_id,
            d.group_id,
            version,
        )
        for d, lp_row in zip(drafts, logps, strict=True)
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fineenvs.train", description=__doc__.split("\n")[0])
    p.add_argument(
        "--model", default="tiny_qwen", help="tiny_qwen | tiny_lfm2 | tiny_qwen3_5 or a model directory"
    )
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--attempts", type=int, default=4)
    p.add_argument(
        "--per-device-batch-size", "--micro-batch-size", dest="per_device_batch_size", type=int, default=2
    )
    p.add_argument("--normalisation", default="per_token")
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--output-dir", type=Path, default=None)
    args = p.parse_args(argv)

    if Path(args.model).is_dir():
        model_dir = Path(args.model)
    else:
        from fineenvs.models import model_builder

        model_dir = model_builder().ensure(args.model)
    out = args.output_dir or Path(tempfile.mkdtemp(prefix="fineenvs-train-"))
    settings = GRPOSettings(
        learning_rate=args.learning_rate,
        per_device_batch_size=args.per_device_batch_size,
        normalisation=args.normalisation,
        max_steps=max(args.steps, 1),
        # The plain float32 path: a check that steps run (also under ``accelerate launch``, where
        # every process must take the same forward passes), not the published precision.
        dtype="float32",
        gradient_checkpointing=False,
        prefix_sharing="padded",
    )
    trainer = CapturedGRPOTrainer(model_dir, settings, out)
    main_process = trainer.accelerator.is_main_process
    for step in range(args.steps):
        rows = synthetic_rows(trainer, seed=step, attempts=args.attempts, version=trainer.policy_version)
        metrics = trainer.step(rows)
        if main_process:
            print(json.dumps({"step": step, **metrics}), flush=True)
    checksum = sum(float(t.double().abs().sum()) for t in trainer.state_dict().values())
    if main_process:
        final = {
            "processes": trainer.accelerator.num_processes,
            "distributed_type": str(trainer.accelerator.distributed_type),
            "policy_version": trainer.policy_version,
            "weights_abs_sum": checksum,
        }
        print(json.dumps({"final": final}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
