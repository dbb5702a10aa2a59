"""The prepared GPU check: GRPO steps on CUDA under bf16 autocast, rows sampled by the embedded
engine on CUDA, for the three tiny models and one real-size configuration.

``python -m benchmarks gpu [--device cuda] [--quick] [--no-real]`` (``scripts/gpu-check.sh``
runs it on a lent GPU machine). Per model it prints: engine tokens/s while sampling the rows, the
median optimizer-step time over ``--steps`` steps, trained tokens/s, peak memory (CUDA allocator,
or the process RSS on CPU) with bytes per parameter, and ``train/ratio`` of the first step, which
is on-policy: the trainer's bf16-autocast logprobs against the engine's.

The real-size configuration is LFM2-shaped (short convolutions and attention, hidden 2048,
16 layers, ~1.1B parameters with the tiny tokenizer's vocabulary), randomly initialised and built
locally: no Hub access is needed, and compute and memory per token match a real checkpoint of
that shape. ``--device cpu --quick`` runs the tiny models only, in seconds (the test tier does).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TINY = ("tiny_qwen", "tiny_lfm2", "tiny_qwen3_5")


def build_real_size(root: Path) -> Path:
    """An LFM2-shaped model of ~1.1B parameters (random weights, the tiny LFM tokenizer)."""
    import torch
    from transformers import AutoTokenizer, Lfm2Config, Lfm2ForCausalLM

    from fineenvs_recipes.tiny import ensure_tiny_model

    out = root / "lfm2_1b_random"
    if (out / "model.safetensors").exists():
        return out
    tiny = ensure_tiny_model("tiny_lfm2")
    tok = AutoTokenizer.from_pretrained(tiny)
    layers = 16
    config = Lfm2Config(
        vocab_size=len(tok),
        hidden_size=2048,
        intermediate_size=8192,
        block_auto_adjust_ff_dim=False,
        num_hidden_layers=layers,
        layer_types=["conv" if i % 3 != 2 else "full_attention" for i in range(layers)],
        num_attention_heads=32,
        num_key_value_heads=8,
        conv_L_cache=3,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = Lfm2ForCausalLM(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _peak_bytes(device: str) -> int:
    import torch

    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def sample_rows(
    gen: Any, *, rows: int, prompt_len: int, turn_tokens: int, temperature: float
) -> tuple[list, float]:
    """Rows the way the proxy builds them (prompt, sampled turn, tool result, sampled turn),
    sampled as one batch per turn; returns (rows, engine tokens/s)."""
    import random

    from fineenvs.engine.generation import SamplingParams
    from fineenvs.train.train_rows import TrainRow

    rng = random.Random(0)
    vocab = min(int(gen.model.get_input_embeddings().weight.shape[0]), 900)
    seqs = [[rng.randrange(20, vocab) for _ in range(prompt_len)] for _ in range(rows)]
    masks = [[0] * prompt_len for _ in range(rows)]
    lps = [[0.0] * prompt_len for _ in range(rows)]
    sampled, seconds = 0, 0.0
    for turn in range(2):
        params = [
            SamplingParams(
                max_tokens=turn_tokens, temperature=temperature, logprobs=True, ignore_eos=True, seed=i
            )
            for i in range(rows)
        ]
        start = time.perf_counter()
        results = gen.generate_batch([(seqs[i], params[i], None) for i in range(rows)])
        seconds += time.perf_counter() - start
        for i, res in enumerate(results):
            seqs[i] += res.token_ids
            masks[i] += [1] * len(res.token_ids)
            lps[i] += res.logprobs
            sampled += len(res.token_ids)
            if turn == 0:
                tool = [rng.randrange(20, vocab) for _ in range(16)]
                seqs[i] += tool
                masks[i] += [0] * len(tool)
                lps[i] += [0.0] * len(tool)
    out = [
        TrainRow(
            input_ids=seqs[i],
            loss_mask=masks[i],
            behaviour_logprobs=lps[i],
            advantage=float(i % 2) - 0.5,
            attempt_id=f"a{i}",
            group_id="g0",
            policy_version=0,
        )  # fmt: skip
        for i in range(rows)
    ]
    return out, sampled / seconds if seconds else 0.0


def check_model(
    name: str,
    model_dir: Path,
    *,
    device: str,
    dtype: str,
    rows: int,
    prompt_len: int,
    turn_tokens: int,
    steps: int,
) -> dict[str, Any]:
    import torch

    from fineenvs.engine.generation import Generator
    from fineenvs.train.grpo import CapturedGRPOTrainer
    from fineenvs.train.grpo_config import GRPOSettings

    temperature = 0.8
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    gen = Generator(model_dir, dtype=dtype, device=device)
    batch, engine_tps = sample_rows(
        gen, rows=rows, prompt_len=prompt_len, turn_tokens=turn_tokens, temperature=temperature
    )
    del gen
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    settings = GRPOSettings(
        learning_rate=3e-6, per_device_batch_size=4, max_steps=steps, dtype=dtype, temperature=temperature,
        gradient_checkpointing=True, token_budget=1 << 20, prefix_sharing="padded",
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        trainer = CapturedGRPOTrainer(model_dir, settings, Path(tmp))
        params = sum(p.numel() for p in trainer.model.parameters())
        times, ratio, trained = [], None, 0.0
        for i in range(steps):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            metrics = trainer.step(batch)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(metrics["train/step_seconds"])
            trained = metrics["train/tokens_trained"]
            if i == 0:
                ratio = metrics["train/ratio"]
        peak = _peak_bytes(device)
    step_s = statistics.median(times)
    return {
        "model": name,
        "params": params,
        "device": device,
        "dtype": dtype,
        "rows": rows,
        "row_tokens": len(batch[0].input_ids),
        "engine_tokens_per_s": round(engine_tps, 1),
        "step_s_median": round(step_s, 4),
        "trained_tokens_per_s": round(trained / step_s, 1) if step_s else 0.0,
        "tokens_per_s": round(sum(len(r.input_ids) for r in batch) / step_s, 1) if step_s else 0.0,
        "peak_memory_gb": round(peak / 1e9, 3),
        "bytes_per_param": round(peak / params, 1),
        "train_ratio_step0": ratio,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks gpu", description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small rows and tiny models only (CPU, tests)")
    parser.add_argument("--no-real", action="store_true", help="skip the real-size configuration")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--dtype", default=None, help="bfloat16 (default on CUDA) or float32 (default on CPU)"
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    import torch

    from fineenvs_recipes.tiny import ensure_tiny_model

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            "benchmarks gpu: --device cuda but torch sees no GPU (use --device cpu --quick)",
            file=sys.stderr,
        )
        return 3
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    size = (
        {"rows": 4, "prompt_len": 32, "turn_tokens": 8}
        if args.quick
        else {"rows": 8, "prompt_len": 1024, "turn_tokens": 256}
    )
    if args.device.startswith("cuda"):
        print(f"GPU: {torch.cuda.get_device_name()} | torch {torch.__version__}", flush=True)
    figures = []
    models: list[tuple[str, Path]] = [(m, ensure_tiny_model(m)) for m in TINY]
    if not args.quick and not args.no_real:
        root = Path(os.environ.get("FINEENVS_GPU_CHECK_DIR", tempfile.gettempdir())) / "fineenvs-gpu-check"
        models.append(("lfm2_1b_random", build_real_size(root)))
    for name, path in models:
        fig = check_model(name, path, device=args.device, dtype=dtype, steps=args.steps, **size)
        figures.append(fig)
        print(
            f"{name:16s} {fig['params'] / 1e6:8.1f}M params  {fig['dtype']:8s} rows {fig['rows']}x{fig['row_tokens']} tok | "
            f"engine {fig['engine_tokens_per_s']:9.1f} tok/s | step {fig['step_s_median']:7.3f} s | "
            f"train {fig['tokens_per_s']:10.1f} tok/s | peak {fig['peak_memory_gb']:7.3f} GB "
            f"({fig['bytes_per_param']:.1f} B/param) | ratio {fig['train_ratio_step0']:.6f}",
            flush=True,
        )
    print(json.dumps({"gpu_check": figures}))
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
