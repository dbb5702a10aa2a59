"""``python -m benchmarks cache-after-push``: after a weight push, reset the prefix cache, or salt
every request with the weight version (vLLM's per-request ``cache_salt``)?

Both keep a replica from serving a prefix computed by older weights; this measures what each
costs on real vLLM (the CPU build, ``install-vllm``). One server (tiny_agent, float32, prefix
caching on, the reload weight sync) and ``--sessions`` agent-like sessions that grow together:
every round each session sends its whole history plus a reply and a tool output (``--grow``
tokens more per round, from ``--start`` tokens) and is answered with ``--reply-tokens`` tokens. After
every ``--push-every`` rounds a real push (pause, reload of the same weights under a new version,
version stamp, resume) runs, under three strategies, interleaved within each run:

- ``reset``: the push drops the prefix cache (``/reset_prefix_cache?reset_running_requests=true``),
  what fineenvs does; requests carry no salt;
- ``salt``: the push leaves the cache alone; every request carries ``cache_salt: v<version>``, so a
  new version's requests cannot hit blocks an older version computed;
- ``none``: pushes, no reset, no salt: the floor, and what serving stale prefixes would cost
  (incorrect: shown only as the lower bound).

Printed per strategy (median over ``--runs``): the push's own time, the round time right after a
push (every session recomputes its prefix), the round time between pushes (warm cache), and the
whole session's time; then each strategy's whole time against ``reset``'s.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

STRATEGIES = ("reset", "salt", "none")


@dataclass
class Figures:
    push_s: list[float] = field(default_factory=list)
    after_push_s: list[float] = field(default_factory=list)
    warm_s: list[float] = field(default_factory=list)
    total_s: float = 0.0


def _words(rng: random.Random, n: int) -> str:
    vocab = ("file", "data", "row", "total", "print", "open", "line", "count", "read", "value", "path", "sum")
    return " ".join(rng.choice(vocab) for _ in range(n))


async def _call(
    client: httpx.AsyncClient,
    url: str,
    name: str,
    messages: list[dict[str, Any]],
    tokens: int,
    salt: str | None,
) -> str:
    body: dict[str, Any] = {
        "model": name,
        "messages": messages,
        "max_tokens": tokens,
        "temperature": 0.8,
        "ignore_eos": True,
    }
    if salt is not None:
        body["cache_salt"] = salt
    reply = await client.post(f"{url}/v1/chat/completions", json=body)
    reply.raise_for_status()
    return str(reply.json()["choices"][0]["message"]["content"] or "ok")


async def _round(
    client: httpx.AsyncClient,
    url: str,
    name: str,
    histories: list[list[dict[str, Any]]],
    args: argparse.Namespace,
    salt: str | None,
    rng: random.Random,
) -> float:
    start = time.perf_counter()
    replies = await asyncio.gather(*(_call(client, url, name, h, args.reply_tokens, salt) for h in histories))
    elapsed = time.perf_counter() - start
    for history, reply in zip(histories, replies, strict=True):
        history.append({"role": "assistant", "content": reply})
        history.append({"role": "user", "content": _words(rng, int(args.grow / 1.3))})
    return elapsed


def _run_strategy(
    strategy: str, url: str, name: str, weights: Any, staging: Path, version0: int, args: argparse.Namespace
) -> tuple[Figures, int]:
    from fineenvs.engine.weights import VLLMReloadWeightSync

    sync = VLLMReloadWeightSync(url, staging)
    if strategy != "reset":
        sync.server.reset_prefix_cache = lambda: None  # type: ignore[method-assign]
    rng = random.Random(1)
    # Each strategy starts from a cold cache: what the previous one left must not help it.
    httpx.post(f"{url}/reset_prefix_cache", timeout=60).raise_for_status()
    histories = [
        [
            {
                "role": "user",
                "content": f"Session {i}: count the rows of data.csv. " + _words(rng, int(args.start / 1.3)),
            }
        ]
        for i in range(args.sessions)
    ]
    figures = Figures()
    version = version0
    began = time.perf_counter()

    async def session() -> None:
        nonlocal version
        async with httpx.AsyncClient(timeout=900) as client:
            for k in range(args.rounds):
                pushed = k > 0 and k % args.push_every == 0
                if pushed:
                    version += 1
                    start = time.perf_counter()
                    await asyncio.to_thread(sync.push, weights, version)
                    figures.push_s.append(time.perf_counter() - start)
                salt = f"v{version}" if strategy == "salt" else None
                took = await _round(client, url, name, histories, args, salt, rng)
                (figures.after_push_s if pushed else figures.warm_s).append(took)

    try:
        asyncio.run(session())
    finally:
        sync.close()
    figures.total_s = time.perf_counter() - began
    return figures, version


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks cache-after-push", description=__doc__)
    parser.add_argument("--model", default="tiny_agent")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--push-every", type=int, default=3)
    parser.add_argument("--start", type=int, default=1500, help="tokens of each session's first prompt")
    parser.add_argument("--grow", type=int, default=500, help="tokens added to each history per round")
    parser.add_argument("--reply-tokens", type=int, default=16)
    args = parser.parse_args(argv)

    from fineenvs.engine.handle import launch_vllm
    from fineenvs.engine.install import installed_python
    from fineenvs.engine.vllm import VLLMServeArgs
    from fineenvs_recipes.tiny import ensure_tiny_model

    python = installed_python("cpu")
    if python is None:
        print("vLLM's CPU build is not installed: python -m fineenvs.engine install-vllm --build cpu")
        return 1
    model_dir = ensure_tiny_model(args.model)
    from transformers import AutoModelForCausalLM

    weights = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    serve = VLLMServeArgs(
        model=str(model_dir), served_model_name=args.model, port=0, dtype="float32", platform="cpu",
        max_model_len=32768, tool_call_parser="hermes", weight_sync="reload", enable_prefix_caching=True,
        python=str(python),
    )  # fmt: skip
    results: dict[str, list[Figures]] = {s: [] for s in STRATEGIES}
    with (
        tempfile.TemporaryDirectory(prefix="bench-salt-") as tmp,
        launch_vllm(serve, Path(tmp), timeout_s=900) as handle,
    ):
        # Warm-up: the first reload and the first long prompts compile kernels; no strategy pays it.
        _run_strategy("reset", handle.url, args.model, weights, Path(tmp) / "staged", 0, args)
        version = 100
        for run in range(args.runs):
            order = STRATEGIES[run % 3 :] + STRATEGIES[: run % 3]  # no strategy always first
            for strategy in order:
                figures, version = _run_strategy(
                    strategy, handle.url, args.model, weights, Path(tmp) / "staged", version, args
                )
                results[strategy].append(figures)
                print(f"run {run + 1}, {strategy}: {figures.total_s:.2f} s", flush=True)

    def med(values: list[float]) -> float:
        return statistics.median(values) if values else float("nan")

    print(
        f"\n{args.sessions} sessions, {args.rounds} rounds ({args.start} -> "
        f"{args.start + args.grow * (args.rounds - 1)} tokens), a push every {args.push_every} rounds, "
        f"{args.reply_tokens}-token replies; median of {args.runs} runs (vLLM CPU build, {args.model}, float32)"
    )
    print(
        f"{'strategy':<10}{'push ms':>9}{'round after push s':>20}{'warm round s':>14}{'session s':>11}{'vs reset':>10}"
    )
    base = med([f.total_s for f in results["reset"]])
    for strategy in STRATEGIES:
        runs = results[strategy]
        total = med([f.total_s for f in runs])
        print(
            f"{strategy:<10}{1000 * med([med(f.push_s) for f in runs]):>9.1f}"
            f"{med([med(f.after_push_s) for f in runs]):>20.3f}{med([med(f.warm_s) for f in runs]):>14.3f}"
            f"{total:>11.2f}{total / base:>9.2f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
