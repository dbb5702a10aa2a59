"""Benchmark of the embedded engine: generated tokens/s and requests/s at 1, 8 and 32 clients.

``python -m fineenvs.bench.engine [--models tiny_qwen,...] [--batch-sizes 1,8] [--max-tokens 16] [--runs 3]``

Each tiny model is served over real HTTP (uvicorn on 127.0.0.1). For every concurrency level,
each run fires that many identical-length requests at once (``ignore_eos``, so every request
generates exactly ``--max-tokens`` tokens) and times the batch; figures are medians over runs.
Two baselines are measured in the same process: plain ``model.generate`` with the same token
count and no server (what HTTP, the chat template, the manual sampling loop and the queue
cost), and the engine with ``max_batch_size=1`` (fully serial) at the same concurrency (what
batching the waiting requests buys).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx


@dataclass
class Figure:
    model: str
    max_batch_size: int
    clients: int
    tokens_per_s: float
    requests_per_s: float
    latency_s: float


async def _batch(url: str, model: str, clients: int, max_tokens: int) -> tuple[float, int]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Count the rows of data.csv and print the total."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.8,
        "logprobs": True,
        "top_logprobs": 0,
        "return_token_ids": True,
    }
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        replies = await asyncio.gather(
            *(client.post(f"{url}/v1/chat/completions", json={**body, "seed": i}) for i in range(clients))
        )
        elapsed = time.perf_counter() - start
    tokens = 0
    for reply in replies:
        reply.raise_for_status()
        tokens += len(reply.json()["choices"][0]["token_ids"])
    return elapsed, tokens


def _baseline(model_dir: Path, max_tokens: int, runs: int) -> float:
    """Tokens/s of plain ``model.generate`` (no server), same prompt style and length."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    enc: Any = tok.apply_chat_template(
        [{"role": "user", "content": "Count the rows of data.csv and print the total."}],
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
    )
    rates = []
    for i in range(runs + 1):
        torch.manual_seed(i)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                **enc,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=True,
                temperature=0.8,
                top_k=0,
                top_p=1.0,
            )
        if i:  # the first run warms up
            rates.append((out.shape[1] - enc["input_ids"].shape[1]) / (time.perf_counter() - start))
    return float(statistics.median(rates))


def run(
    models: list[str], batch_sizes: list[int], concurrency: list[int], max_tokens: int, runs: int
) -> list[tuple[str, float, list[Figure]]]:
    from fineenvs.engine.server import create_engine_app, serve_in_thread
    from fineenvs.models import ensure_tiny_model

    results = []
    for name in models:
        model_dir = ensure_tiny_model(name)
        baseline = _baseline(model_dir, max_tokens, runs)
        figures = []
        for batch_size in batch_sizes:
            app = create_engine_app(
                model_dir,
                served_model_name=name,
                max_queue=max(64, 2 * max(concurrency)),
                max_batch_size=batch_size,
            )
            with serve_in_thread(app) as url:
                asyncio.run(_batch(url, name, 1, max_tokens))  # warm-up
                for clients in concurrency:
                    samples = [asyncio.run(_batch(url, name, clients, max_tokens)) for _ in range(runs)]
                    elapsed = statistics.median(s[0] for s in samples)
                    tokens = statistics.median(s[1] for s in samples)
                    figures.append(
                        Figure(name, batch_size, clients, tokens / elapsed, clients / elapsed, elapsed)
                    )
        results.append((name, baseline, figures))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fineenvs.bench.engine", description=__doc__)
    parser.add_argument("--models", default="tiny_qwen,tiny_lfm2,tiny_qwen3_5")
    parser.add_argument("--batch-sizes", default="1,8", help="engine max_batch_size values (1 = serial)")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads, as `engine serve` uses for tiny models"
    )
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    models = [m for m in args.models.split(",") if m]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    concurrency = [int(c) for c in args.concurrency.split(",") if c]
    start = time.perf_counter()
    results = run(models, batch_sizes, concurrency, args.max_tokens, args.runs)
    print(
        f"embedded engine, {args.max_tokens} tokens per request, median of {args.runs} runs "
        f"(CPU, float32, {args.threads} torch thread(s))"
    )
    header = f"{'model':<14}{'batch':>6}{'clients':>8}{'tok/s':>9}{'req/s':>8}{'wall s':>8}{'vs generate':>12}{'vs serial':>10}"
    print(header)
    for name, baseline, figures in results:
        print(f"{name:<14}{'HF generate, 1 request, no server:':>37}{baseline:>9.1f} tok/s")
        serial = {f.clients: f.tokens_per_s for f in figures if f.max_batch_size == 1}
        for f in figures:
            vs_serial = (
                f"{f.tokens_per_s / serial[f.clients]:>9.2f}x" if f.clients in serial else f"{'-':>10}"
            )
            print(
                f"{f.model:<14}{f.max_batch_size:>6}{f.clients:>8}{f.tokens_per_s:>9.1f}{f.requests_per_s:>8.2f}"
                f"{f.latency_s:>8.2f}{f.tokens_per_s / baseline:>11.2f}x{vs_serial}"
            )
    print(f"total {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
