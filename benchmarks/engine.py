"""Benchmark of the engines: the embedded engine's throughput and prefix cache, and the embedded
engine against real vLLM (its CPU build) in the same run.

``python -m benchmarks.engine [--models tiny_qwen,...] [--batch-sizes 1,8] [--max-tokens 16] [--runs 3]
[--sections throughput,session,vllm] [--session-lengths 2000:20000:500] [--compare-every 6]
[--vllm-model tiny_agent] [--vllm-session-lengths 2000:12000:1000]``

vLLM against the embedded engine (section ``vllm``, when ``python -m fineenvs.engine install-vllm``
has built vLLM's environment). Both serve the same model (``--vllm-model``: tiny_agent, which vLLM's
CPU attention can serve) in float32, each started as a run starts it (the embedded engine as its
own process with one torch thread; vLLM by the launcher, compiled, prefix caching on, torch.compile
cache warm after the first start). Per engine, medians over ``--runs``: start-up (launch to healthy),
tokens/s at 1, 8 and 32 clients (``--max-tokens`` each, ``ignore_eos``), and time to first token
along a growing agent history (chat messages: each call resends the history, the sampled reply and
a tool result), from the prefix cache and, on the same prompts, after ``/reset_prefix_cache``.

Throughput (generated tokens/s and requests/s).

Each tiny model is served over real HTTP (uvicorn on 127.0.0.1). For every concurrency level,
each run fires that many identical-length requests at once (``ignore_eos``, so every request
generates exactly ``--max-tokens`` tokens) and times the batch; figures are medians over runs.
Two baselines are measured in the same process: plain ``model.generate`` with the same token
count and no server (what HTTP, the chat template, the manual sampling loop and the queue
cost), and the engine with ``max_batch_size=1`` (fully serial) at the same concurrency (what
batching the waiting requests buys).

Session (``fineenvs.engine.prefix_cache``). An agent-like conversation grows from 2k to 20k
tokens: each call is answered with a sampled reply, and the next call resends the history, that
reply as sampled and a tool result that brings it to the next length (500 tokens more per call
by default: a reply and a tool output of an agent's turn). Time to first token (the
prefill and one sampled token) is measured at every call with the prefix cache and, on the very
same prompts, without it (at every ``--compare-every``-th call and the last); figures are medians over runs, each run from an empty cache.
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


@dataclass
class SessionFigure:
    model: str
    prompt_tokens: int
    uncached_s: float
    cached_s: float


def _session(
    model_dir: Path, name: str, lengths: list[int], reply_tokens: int, runs: int, compare_every: int
) -> list[SessionFigure]:
    import random

    from fineenvs.engine.generation import Generator, SamplingParams

    cached = Generator(model_dir)
    plain = Generator(model_dir, prefix_cache_bytes=0)
    first = SamplingParams(max_tokens=1, temperature=0.8, seed=0, logprobs=True)
    timed: dict[int, list[float]] = {}
    prompts: list[list[int]] = []
    for r in range(runs + 1):  # the first run warms up and records the prompts
        cached.prefix_cache.clear()
        rng = random.Random(0)
        history: list[int] = []
        for k, length in enumerate(lengths):
            history += [rng.randrange(20, 900) for _ in range(max(1, length - len(history)))]
            start = time.perf_counter()
            cached.generate(history, first)
            if r:
                timed.setdefault(k, []).append(time.perf_counter() - start)
            else:
                prompts.append(list(history))
            reply = SamplingParams(max_tokens=reply_tokens, temperature=0.8, seed=k, ignore_eos=True)
            history = history + cached.generate(history, reply).token_ids
    figures = []
    compared = [k for k in range(len(prompts)) if k % compare_every == 0 or k == len(prompts) - 1]
    for k in compared:
        samples = []
        for _ in range(runs):
            start = time.perf_counter()
            plain.generate(prompts[k], first)
            samples.append(time.perf_counter() - start)
        figures.append(
            SessionFigure(name, len(prompts[k]), statistics.median(samples), statistics.median(timed[k]))
        )
    return figures


def run(
    models: list[str], batch_sizes: list[int], concurrency: list[int], max_tokens: int, runs: int
) -> list[tuple[str, float, list[Figure]]]:
    from fineenvs.engine.server import create_engine_app, serve_in_thread
    from fineenvs_recipes.tiny import ensure_tiny_model

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
    parser = argparse.ArgumentParser(prog="python -m benchmarks.engine", description=__doc__)
    parser.add_argument("--models", default="tiny_qwen,tiny_lfm2,tiny_qwen3_5")
    parser.add_argument(
        "--sections", default="throughput,session,vllm", help="throughput, session, vllm, comma-separated"
    )
    parser.add_argument(
        "--vllm-model", default="tiny_agent", help="the model both engines serve in section vllm"
    )
    parser.add_argument(
        "--vllm-session-lengths", default="2000:12000:1000", help="section vllm's session, start:stop:step"
    )
    parser.add_argument("--batch-sizes", default="1,8", help="engine max_batch_size values (1 = serial)")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--session-lengths",
        default="2000:20000:500",
        help="prompt tokens of the session's calls, start:stop:step (each call adds a reply and a tool result)",
    )
    parser.add_argument(
        "--compare-every",
        type=int,
        default=6,
        help="time the uncached engine at every n-th call and the last",
    )
    parser.add_argument(
        "--reply-tokens", type=int, default=64, help="tokens sampled per reply in the session"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads, as `engine serve` uses for tiny models"
    )
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    models = [m for m in args.models.split(",") if m]
    sections = {s for s in args.sections.split(",") if s}
    if not sections or sections - {"throughput", "session", "vllm"}:
        parser.error(f"--sections {args.sections!r}: name throughput, session, vllm, comma-separated")
    try:
        lo, hi, step = (int(v) for v in args.session_lengths.split(":"))
        lengths = list(range(lo, hi + 1, step))
    except ValueError:
        parser.error(f"--session-lengths {args.session_lengths!r}: give start:stop:step, e.g. 2000:20000:500")
    if args.compare_every < 1 or args.reply_tokens < 1 or args.runs < 1:
        parser.error("--compare-every, --reply-tokens and --runs must be >= 1")
    if not lengths or lo < 1:
        parser.error(
            f"--session-lengths {args.session_lengths!r} names no call: start must be >= 1 and <= stop"
        )
    start = time.perf_counter()
    if "throughput" in sections:
        _print_throughput(models, args)
    if "session" in sections:
        _print_session(models, lengths, args)
    if "vllm" in sections:
        _print_versus(args)
    print(f"total {time.perf_counter() - start:.1f} s")
    return 0


def _print_throughput(models: list[str], args: argparse.Namespace) -> None:
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    concurrency = [int(c) for c in args.concurrency.split(",") if c]
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


def _print_session(models: list[str], lengths: list[int], args: argparse.Namespace) -> None:
    from fineenvs_recipes.tiny import ensure_tiny_model

    print(
        f"prefix cache: time to first token along a growing session ({lengths[0]} -> {lengths[-1]} tokens, "
        f"{args.reply_tokens}-token replies), median of {args.runs} runs (CPU, float32, {args.threads} thread(s))"
    )
    print(f"{'model':<14}{'prompt':>8}{'uncached s':>12}{'cached s':>10}{'cached/uncached':>17}")
    for name in models:
        figures = _session(
            ensure_tiny_model(name), name, lengths, args.reply_tokens, args.runs, args.compare_every
        )
        for f in figures:
            print(
                f"{f.model:<14}{f.prompt_tokens:>8}{f.uncached_s:>12.3f}{f.cached_s:>10.3f}"
                f"{f.cached_s / f.uncached_s:>16.1%}"
            )
        last = figures[-1]
        print(
            f"{name}: at {last.prompt_tokens} tokens a cached call's first token takes "
            f"{last.cached_s / last.uncached_s:.1%} of an uncached one's (target <= 15%)"
        )


# --------------------------------------------------------------------------- vLLM vs embedded


@dataclass
class EngineFigures:
    engine: str
    startup_s: float
    tokens_per_s: dict[int, float]
    ttft: list[tuple[int, float, float]]  # (prompt tokens, cached s, uncached s)


def _launch(engine: str, model_dir: Path, name: str, log_dir: Path) -> Any:
    from fineenvs.engine.handle import launch_transformers_engine, launch_vllm

    if engine == "embedded":
        return launch_transformers_engine(str(model_dir), log_dir=log_dir, served_model_name=name)
    from fineenvs.engine.install import installed_python
    from fineenvs.engine.vllm import VLLMServeArgs

    python = installed_python("cpu")
    assert python is not None
    args = VLLMServeArgs(
        model=str(model_dir), served_model_name=name, port=0, dtype="float32", platform="cpu",
        max_model_len=32768, tool_call_parser="hermes", weight_sync="reload", enable_prefix_caching=True,
        python=str(python),
    )  # fmt: skip
    return launch_vllm(args, log_dir, timeout_s=900)


def _words(rng: Any, n: int) -> str:
    vocab = ("file", "data", "row", "total", "print", "open", "line", "count", "read", "value", "path", "sum")
    return " ".join(rng.choice(vocab) for _ in range(n))


async def _ttft(
    client: httpx.AsyncClient, url: str, name: str, messages: list[dict[str, Any]]
) -> tuple[float, int]:
    body = {
        "model": name,
        "messages": messages,
        "max_tokens": 1,
        "temperature": 0.8,
        "return_token_ids": True,
    }
    start = time.perf_counter()
    reply = await client.post(f"{url}/v1/chat/completions", json=body)
    elapsed = time.perf_counter() - start
    reply.raise_for_status()
    return elapsed, len(reply.json()["prompt_token_ids"])


async def _session_http(
    url: str, name: str, lengths: list[int], reply_tokens: int
) -> list[tuple[int, float, float]]:
    """TTFT along a growing chat: cached, then the same prompt after /reset_prefix_cache."""
    import random

    rng = random.Random(0)
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Count the rows of data.csv. " + _words(rng, 200)}
    ]
    out = []
    async with httpx.AsyncClient(timeout=900) as client:
        for target in lengths:
            cached, tokens = await _ttft(client, url, name, messages)
            (await client.post(f"{url}/reset_prefix_cache")).raise_for_status()
            uncached, _ = await _ttft(client, url, name, messages)
            out.append((tokens, cached, uncached))
            body = {"model": name, "messages": messages, "max_tokens": reply_tokens, "temperature": 0.8,
                    "ignore_eos": True}  # fmt: skip
            reply = (await client.post(f"{url}/v1/chat/completions", json=body)).json()
            messages.append(
                {"role": "assistant", "content": reply["choices"][0]["message"]["content"] or "ok"}
            )
            # A tool result that brings the history to the next length (~1.3 tokens per word here).
            messages.append({"role": "user", "content": _words(rng, max(10, int((target - tokens) / 1.3)))})
    return out


def _versus(args: argparse.Namespace, lengths: list[int], concurrency: list[int]) -> list[EngineFigures]:
    import tempfile

    from fineenvs_recipes.tiny import ensure_tiny_model

    name = args.vllm_model
    model_dir = ensure_tiny_model(name)
    results = []
    for engine in ("embedded", "vllm"):
        startups: list[float] = []
        rates: dict[int, list[float]] = {c: [] for c in concurrency}
        sessions: list[list[tuple[int, float, float]]] = []
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory(prefix=f"bench-{engine}-") as tmp:
                launch = _launch(engine, model_dir, name, Path(tmp))
                start = time.perf_counter()
                with launch as handle:
                    startups.append(time.perf_counter() - start)
                    asyncio.run(_batch(handle.url, name, 1, args.max_tokens))  # warm-up
                    for clients in concurrency:
                        elapsed, tokens = asyncio.run(_batch(handle.url, name, clients, args.max_tokens))
                        rates[clients].append(tokens / elapsed)
                    sessions.append(asyncio.run(_session_http(handle.url, name, lengths, args.reply_tokens)))
        ttft = [
            (
                sessions[0][k][0],
                statistics.median(s[k][1] for s in sessions),
                statistics.median(s[k][2] for s in sessions),
            )
            for k in range(len(lengths))
        ]
        results.append(
            EngineFigures(
                engine, statistics.median(startups), {c: statistics.median(r) for c, r in rates.items()}, ttft
            )
        )
    return results


def _print_versus(args: argparse.Namespace) -> None:
    from fineenvs.engine.install import installed_python

    if installed_python("cpu") is None:
        print(
            "section vllm: vLLM's CPU build is not installed (python -m fineenvs.engine install-vllm); skipped"
        )
        return
    lo, hi, step = (int(v) for v in args.vllm_session_lengths.split(":"))
    lengths = list(range(lo, hi + 1, step))
    concurrency = [int(c) for c in args.concurrency.split(",") if c]
    figures = _versus(args, lengths, concurrency)
    embedded, vllm = figures
    print(
        f"vLLM (CPU build 0.32.0) against the embedded engine, {args.vllm_model}, float32, median of "
        f"{args.runs} runs, {args.max_tokens} tokens per request"
    )
    print(f"{'':<28}{'embedded':>12}{'vLLM':>12}{'vLLM/embedded':>15}")
    print(
        f"{'start-up s':<28}{embedded.startup_s:>12.1f}{vllm.startup_s:>12.1f}{vllm.startup_s / embedded.startup_s:>14.2f}x"
    )
    for c in concurrency:
        e, v = embedded.tokens_per_s[c], vllm.tokens_per_s[c]
        print(f"{f'tok/s, {c} client(s)':<28}{e:>12.1f}{v:>12.1f}{v / e:>14.2f}x")
    print("time to first token along a growing session, cached / after reset_prefix_cache (s)")
    print(
        f"{'prompt':>8}{'embedded cached':>17}{'uncached':>10}{'vLLM cached':>13}{'uncached':>10}{'vLLM/emb cached':>17}"
    )
    for (tokens, ec, eu), (_, vc, vu) in zip(embedded.ttft, vllm.ttft, strict=True):
        print(f"{tokens:>8}{ec:>17.3f}{eu:>10.3f}{vc:>13.3f}{vu:>10.3f}{vc / ec:>16.2f}x")


if __name__ == "__main__":
    raise SystemExit(main())
