"""Benchmark of the trajectory graph: ``python -m benchmarks.tree`` (or ``benchmarks tree``).

Builds graphs for synthetic sessions (agent chains of tool turns, retries, subagents, re-rendered
turns, compaction when a prompt would pass ``--max-prompt`` tokens) and prints:

1. scaling: time per call and per 1k unique tokens from 10 to ``--max-calls`` calls, the token
   ids the graph holds against the sum of all prompt lengths;
2. the same sessions linked by a straightforward all-pairs longest-prefix search (the baseline,
   measured in the same run, up to ``--baseline-max-calls``), and whether both agree;
3. in-order against shuffled arrival (same graph required);
4. row export (every leaf's row): time per 1M row tokens.

Measured on the shared 2-core development machine (CPU time, default flags): 92-110 us per call
and 185-216 us per 1k unique tokens from 100 to 10,000 calls (flat: linear in unique tokens; the
prompt itself is read at about 7 ns per token); all-pairs 8x slower at 100 calls and 19x at 300
(quadratic: 70 -> 544 ms for 3x the calls); shuffled arrival 1.8x in-order with the identical
graph; row export 30 ns per row token from 100 to 10,000 calls; the graph holds 0.04x the sum of
prompt lengths (6.0M token ids for 147M prompt tokens, 5.0M unique).

Every figure is the median of ``--repeats`` runs of process CPU time (stable on a shared machine,
where wall time mostly measures the neighbours), with the cyclic garbage collector paused while
timing. Times exclude generating the synthetic calls.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections.abc import Callable, Iterator
from functools import partial

import numpy as np

from fineenvs.trajectory.graph import TrajectoryGraph
from fineenvs.trajectory.node import CallNode
from fineenvs.trajectory.rows import RowOptions, build_rows


def synthetic_session(
    n_calls: int,
    *,
    max_prompt: int = 32768,
    seed: int = 0,
    retry_p: float = 0.05,
    subagent_p: float = 0.02,
    drift_p: float = 0.01,
    vocab: int = 150_000,
) -> Iterator[CallNode]:
    """Calls of one synthetic session, lazily (only the current chain is kept in memory)."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab, 2000).tolist()

    def toks(lo: int, hi: int) -> list[int]:
        out: list[int] = rng.integers(0, vocab, int(rng.integers(lo, hi))).tolist()
        return out

    def call(i: int, prompt: list[int], sampled: list[int]) -> CallNode:
        lps: list[float] = (-rng.exponential(0.5, len(sampled))).tolist()
        return CallNode(f"c{i:06d}", prompt, sampled, lps, "tool_calls", True, i)

    end: list[int] = []
    i = 0
    while i < n_calls:
        ctx = toks(50, 600)
        if not end or len(end) + len(ctx) + 300 > max_prompt or rng.random() < subagent_p:
            # new root: a subagent (its own system prompt) or a compacted conversation
            variant = list(system)
            variant[int(rng.integers(10, 1990))] = int(rng.integers(0, vocab))
            prompt = variant + toks(200, 1000)
        else:
            prompt = end + ctx
        if rng.random() < retry_p and i + 1 < n_calls:
            yield call(i, prompt, toks(20, 300))  # abandoned attempt, same prompt
            i += 1
        sampled = toks(20, 300)
        yield call(i, prompt, sampled)
        i += 1
        end = prompt + sampled
        if rng.random() < drift_p and len(sampled) > 4:
            cut = len(end) - len(sampled) + int(rng.integers(1, len(sampled)))
            end = end[:cut] + toks(5, 40)  # the harness re-rendered the model's output


def all_pairs_parents(nodes: list[CallNode]) -> dict[str, str | None]:
    """Reference linker: every call against every other call (quadratic; the baseline)."""
    ends = [(n.prompt_ids + n.sampled_ids, n) for n in nodes]
    out: dict[str, str | None] = {}
    for n in nodes:
        p = n.prompt_ids
        best: CallNode | None = None
        best_len = -1
        for e, m in ends:
            le = len(e)
            if m is n or le > len(p) or (le == len(p) and not m.sampled_ids) or le < best_len:
                continue
            if p[:le] != e:
                continue
            if le > best_len or (best is not None and m.order_key() < best.order_key()):
                best, best_len = m, le
        out[n.node_id] = None if best is None else best.node_id
    return out


def _median_time(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        gc.collect()
        gc.disable()  # a cyclic-GC pass over millions of token lists would dominate the noise
        try:
            t0 = time.process_time()
            result = fn()
            times.append(time.process_time() - t0)
            del result  # freeing the result is not part of building it
        finally:
            gc.enable()
    return statistics.median(times)


def _build_lazy(n_calls: int, max_prompt: int, seed: int) -> tuple[float, TrajectoryGraph]:
    """Build from the lazy generator, timing only ``add``."""
    g = TrajectoryGraph()
    spent = 0.0
    gc.collect()
    gc.disable()
    try:
        for node in synthetic_session(n_calls, max_prompt=max_prompt, seed=seed):
            t0 = time.process_time()
            g.add(node)
            spent += time.process_time() - t0
    finally:
        gc.enable()
    return spent, g


def run(args: argparse.Namespace) -> None:
    sizes = [n for n in (10, 100, 1000, 3000, 10_000, 30_000, 100_000) if n <= args.max_calls]
    print(
        f"trajectory graph benchmark: prompts up to {args.max_prompt} tokens, median of {args.repeats} runs\n"
    )
    print("1. scaling (in-order arrival, lazy session)")
    hdr = f"{'calls':>7} {'unique tok':>11} {'sum prompts':>12} {'held tok':>9} {'held/prompts':>12} "
    print(hdr + f"{'ms total':>9} {'us/call':>8} {'us/1k uniq':>10} {'ns/prompt tok':>13}")
    for n in sizes:
        reps = args.repeats if n < 10_000 else max(1, args.repeats // 2)
        times, g = [], None
        for _ in range(reps):
            t, g = _build_lazy(n, args.max_prompt, args.seed)
            times.append(t)
        assert g is not None
        t = statistics.median(times)
        s = g.stats()
        print(
            f"{n:>7} {s.unique_tokens:>11,} {s.prompt_tokens:>12,} {s.held_tokens:>9,} "
            f"{s.held_tokens / s.prompt_tokens:>12.4f} {t * 1e3:>9.1f} {t / n * 1e6:>8.1f} "
            f"{t / s.unique_tokens * 1e9:>10.1f} {t / s.prompt_tokens * 1e9:>13.1f}"
        )

    print(f"\n2. all-pairs baseline (materialised sessions up to {args.baseline_max_calls} calls)")
    print(f"{'calls':>7} {'graph ms':>9} {'all-pairs ms':>12} {'speed-up':>9} {'same parents':>12}")
    for n in [n for n in (10, 30, 100, 300, 1000, 3000) if n <= args.baseline_max_calls]:
        nodes = list(synthetic_session(n, max_prompt=args.max_prompt, seed=args.seed))
        tg = _median_time(partial(TrajectoryGraph, nodes), args.repeats)
        tb = _median_time(partial(all_pairs_parents, nodes), args.repeats if n < 300 else 1)
        g = TrajectoryGraph(nodes)
        ref = all_pairs_parents(nodes)
        same = all(g.parent(k) == v for k, v in ref.items())
        print(f"{n:>7} {tg * 1e3:>9.1f} {tb * 1e3:>12.1f} {tb / tg:>8.1f}x {'yes' if same else 'NO':>12}")

    print(f"\n3. arrival order ({args.shuffle_calls} calls, materialised)")
    nodes = list(synthetic_session(args.shuffle_calls, max_prompt=args.max_prompt, seed=args.seed))
    shuffled = list(nodes)
    random.Random(args.seed).shuffle(shuffled)
    t_in = _median_time(lambda: TrajectoryGraph(nodes), args.repeats)
    t_sh = _median_time(lambda: TrajectoryGraph(shuffled), args.repeats)
    g_in, g_sh = TrajectoryGraph(nodes), TrajectoryGraph(shuffled)
    same = (
        all(g_in.parent(k) == g_sh.parent(k) for k in g_in.node_ids())
        and g_in.discarded() == g_sh.discarded()
    )
    print(
        f"  in-order {t_in * 1e3:.1f} ms, shuffled {t_sh * 1e3:.1f} ms, ratio {t_sh / t_in:.2f}x, same graph: {same}"
    )
    st = g_sh.stats()
    print(
        f"  held tokens in-order {g_in.stats().held_tokens:,} vs shuffled {st.held_tokens:,} (unique {st.unique_tokens:,})"
    )

    print("\n4. row export (every leaf's row, per_row policy, no budget)")
    print(f"{'calls':>7} {'rows':>6} {'row tokens':>12} {'ms':>8} {'ms/1M row tok':>13}")
    opts = RowOptions(max_tokens=10**9, drop_discarded=False)
    for n in sizes:
        _, g = _build_lazy(n, args.max_prompt, args.seed)
        rs = build_rows(g, opts)
        tr = _median_time(partial(build_rows, g, opts), args.repeats if n < 10_000 else 1)
        tok = sum(len(r.input_ids) for r in rs.rows)
        print(f"{n:>7} {len(rs.rows):>6} {tok:>12,} {tr * 1e3:>8.1f} {tr / tok * 1e9:>13.1f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tree", description=__doc__.split("\n\n")[0])
    p.add_argument("--max-calls", type=int, default=10_000, help="largest session (10, 100, ... up to this)")
    p.add_argument("--max-prompt", type=int, default=32768, help="prompt length at which a chain compacts")
    p.add_argument("--baseline-max-calls", type=int, default=300, help="largest session for all-pairs")
    p.add_argument("--shuffle-calls", type=int, default=1000, help="session size for in-order vs shuffled")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    run(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
