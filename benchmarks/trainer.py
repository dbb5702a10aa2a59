"""Benchmark of one GRPO optimizer step, padded against prefix-shared: ``python -m benchmarks trainer``.

``python -m benchmarks trainer [--models tiny_qwen,tiny_lfm2,tiny_qwen3_5]
[--cases claude_code,opencode,codex,mini_swe_agent,synthetic] [--runs 3] [--max-prompt-tokens 2048]``

Rows. Each case is one GRPO group whose attempts open with a prompt recorded from a real harness
(``tests/trajectory/recorded/<harness>.json``: the proxy's capture of Claude Code, OpenCode, Codex
and Mini-SWE-Agent against the embedded engine, token ids of the tiny tokenizer), continued by
turns whose tokens are drawn from that session (a reply, then a tool result the length of the
recorded one), built into calls and then rows by the trajectory code, as the rollout layer does:

- ``claude_code``: the harness re-renders the previous reply in every next prompt (thinking
  stripped), so every call forks the trajectory graph: one row per call (8 turns -> 8 rows per
  attempt, the shape behind the published 162M-451M tokens processed for 12.5M-18.7M trained);
- ``opencode``, ``codex``, ``mini_swe_agent``: the history is sent back as sampled, one row per
  attempt (OpenCode adds its title call, an auxiliary row with its own short prompt);
- ``synthetic``: a random 1,000-token prompt, 8 attempts of two turns, each attempt forked once
  (a retry after its first turn): 16 rows.

Long prompts are cut to ``--max-prompt-tokens`` (the system prompt's head and the task at the end)
so that a padded step fits a CPU: attention is quadratic, and the recorded Claude Code prompt is
44k tokens of the tiny tokenizer.

Figures (per model and case): tokens the step forwards against the unique tokens of its prefix
tree, the step time (``CapturedGRPOTrainer.step``: forward, backward, clipping, AdamW; wall and
process CPU time, median of ``--runs`` after an untimed step on two of the rows) and the peak resident memory the
step adds. Each measurement runs in its own process: memory is ``ru_maxrss`` after the steps minus
the resident size before the first one (activations, gradients, AdamW state and temporaries; the
AdamW state is the same for both paths). The two paths' losses are compared. One torch thread by default (``--threads``): on a shared
machine, OpenMP's barriers wait for threads the neighbours' jobs have descheduled, which costs most
where operations are many and small (measured on the loaded 2-core machine, load average 9: the
shared Claude Code step took 43-78 s wall with 2 threads, 7-13 s with one).

Measured (default flags, the shared 2-core machine): the shared step forwards exactly the tree's
unique tokens (padded: 3.4-10.8x them); Claude Code cases 7.3-11.0x faster in CPU time, the other
harnesses' groups of 8 4.1-4.8x, the synthetic group 3.0-3.2x; peak memory added 0.15-0.25 of
padded; losses equal to 1e-7 (benchmarks/results/2026-12-02-trainer-prefix-sharing-2core.md).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from fineenvs.train.train_rows import TrainRow
from fineenvs.trajectory import CallNode, RowOptions, build_session
from fineenvs.trajectory.rows import SharedPrefix

RECORDED_DIR = Path(__file__).resolve().parents[1] / "tests" / "trajectory" / "recorded"
HARNESS_CASES = ("claude_code", "opencode", "codex", "mini_swe_agent")
CASES = (*HARNESS_CASES, "synthetic")
MODELS = ("tiny_qwen", "tiny_lfm2", "tiny_qwen3_5")
TASK_TOKENS = 256  # kept from a long prompt's end when it is cut: the task and the turn header


@dataclass(frozen=True)
class Recorded:
    """What one recorded session gives the row builder (token ids of the tiny tokenizer)."""

    harness: str
    prompt: list[int]  # the agent's first prompt: system prompt, tools, task
    reply: list[int]  # its first sampled turn
    tool: list[int]  # what the harness appended before the next call: tool result and glue
    aux_prompt: list[int] | None  # an auxiliary call's prompt (OpenCode's title generator)
    prompt_tokens_recorded: int


def load_recorded(
    harness: str, *, max_prompt_tokens: int | None = None, folder: Path | None = None
) -> Recorded:
    path = (folder or RECORDED_DIR) / f"{harness}.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"no recorded session {path}: the trainer benchmark reads the proxy sessions recorded in a "
            "source checkout (tests/trajectory/recorded); run it from the repository"
        )
    calls = orjson.loads(path.read_bytes())["calls"]
    agent = [c for c in calls if c.get("has_tools")]
    if len(agent) < 2:
        raise ValueError(f"{path}: needs two agent calls (with tools) to read a tool result from")
    first, second = agent[0], agent[1]
    end = list(first["prompt_ids"]) + list(first["sampled_ids"])
    if list(second["prompt_ids"][: len(end)]) != end:
        raise ValueError(f"{path}: the second agent call does not extend the first; no tool result to read")
    prompt = list(first["prompt_ids"])
    n = len(prompt)
    if max_prompt_tokens is not None and n > max_prompt_tokens:
        tail = min(TASK_TOKENS, max_prompt_tokens // 4)
        prompt = prompt[: max_prompt_tokens - tail] + prompt[n - tail :]
    aux = [c for c in calls if not c.get("has_tools")]
    aux_prompt = list(aux[0]["prompt_ids"]) if aux else None
    if aux_prompt is not None and max_prompt_tokens is not None:
        aux_prompt = aux_prompt[:max_prompt_tokens]
    return Recorded(
        harness, prompt, list(first["sampled_ids"]), list(second["prompt_ids"][len(end) :]), aux_prompt, n
    )


def _tokens(rng: random.Random, pool: Sequence[int], n: int) -> list[int]:
    return [pool[rng.randrange(len(pool))] for _ in range(max(1, n))]


def attempt_calls(
    rec: Recorded,
    attempt: int,
    *,
    turns: int,
    rerender: bool,
    rng: random.Random,
    reply_scale: float = 1.0,
    tool_scale: float = 1.0,
) -> list[CallNode]:
    """One attempt's model calls: ``turns`` replies, each followed by a tool result.

    Token ids come from the recorded session (so they have its token statistics); lengths are the
    recorded reply's and tool result's, times a factor in [0.5, 1.5]. ``rerender``: the next prompt
    holds the previous reply with its last tokens changed (Claude Code strips thinking), which
    forks the trajectory graph at every call."""
    pool = rec.prompt[-TASK_TOKENS:] + rec.reply + rec.tool
    history = list(rec.prompt)
    calls: list[CallNode] = []
    if rec.aux_prompt is not None:
        title = _tokens(rng, pool, 4)
        calls.append(_call(f"a{attempt}-title", rec.aux_prompt, title, rng, tools=False, index=0))
    for t in range(turns):
        reply = _tokens(rng, pool, round(len(rec.reply) * reply_scale * rng.uniform(0.5, 1.5)))
        calls.append(_call(f"a{attempt}-t{t}", history, reply, rng, tools=True, index=t + 1))
        shown = reply
        if rerender:
            cut = max(1, len(reply) // 4)
            shown = reply[:-cut] + _tokens(rng, pool, cut)
        tool = _tokens(rng, pool, round(len(rec.tool) * tool_scale * rng.uniform(0.5, 1.5)))
        history = history + shown + tool
    return calls


def _call(
    node_id: str, prompt: list[int], sampled: list[int], rng: random.Random, *, tools: bool, index: int
) -> CallNode:
    logprobs = [-rng.uniform(0.01, 3.0) for _ in sampled]
    finish = "tool_calls" if tools else "stop"
    return CallNode(node_id, list(prompt), sampled, logprobs, finish, tools, index)


def calls_to_rows(
    calls: list[CallNode],
    *,
    advantage: float,
    attempt_id: str,
    group_id: str,
    shared_prefix: str = "per_row",
) -> list[TrainRow]:
    """The trainable rows of one attempt's calls, as the rollout layer builds them."""
    options = RowOptions(max_tokens=1 << 20, shared_prefix=SharedPrefix(shared_prefix))
    res = build_session(calls, {"attempt": attempt_id}, options, min_calls=1)
    return [
        TrainRow.from_row(r, advantage=advantage, attempt_id=attempt_id, group_id=group_id, policy_version=0)
        for r in res.training_rows()
    ]


def group_rows(
    rec: Recorded,
    *,
    attempts: int,
    turns: int,
    rerender: bool,
    seed: int = 0,
    shared_prefix: str = "per_row",
    reply_scale: float = 1.0,
    tool_scale: float = 1.0,
) -> list[TrainRow]:
    """One GRPO group: ``attempts`` attempts at the recorded prompt, advantages centred."""
    rng = random.Random(seed)
    rows: list[TrainRow] = []
    for a in range(attempts):
        calls = attempt_calls(
            rec, a, turns=turns, rerender=rerender, rng=rng, reply_scale=reply_scale, tool_scale=tool_scale
        )
        advantage = a - (attempts - 1) / 2
        rows += calls_to_rows(
            calls,
            advantage=advantage,
            attempt_id=f"{rec.harness}-a{a}",
            group_id=rec.harness,
            shared_prefix=shared_prefix,
        )
    return rows


def synthetic_group(
    *,
    attempts: int = 8,
    prompt_tokens: int = 1000,
    turn_tokens: int = 60,
    tool_tokens: int = 80,
    vocab: int = 1000,
    seed: int = 0,
    shared_prefix: str = "per_row",
) -> list[TrainRow]:
    """``attempts`` attempts sharing one random prompt; each has two turns and one retry of its
    second call (two continuations of the same first turn), so its first turn is held by 2 rows."""
    rng = random.Random(seed)
    prompt = [rng.randrange(vocab) for _ in range(prompt_tokens)]
    rows: list[TrainRow] = []
    for a in range(attempts):
        turn = [rng.randrange(vocab) for _ in range(turn_tokens)]
        tool = [rng.randrange(vocab) for _ in range(tool_tokens)]
        calls = [_call(f"s{a}-t0", prompt, turn, rng, tools=True, index=0)]
        for k in range(2):
            second = [rng.randrange(vocab) for _ in range(turn_tokens + k)]
            # Both continue: a forked history (each kept), not a discarded retry.
            calls.append(_call(f"s{a}-t1-{k}", prompt + turn + tool, second, rng, tools=True, index=1 + k))
            calls.append(
                _call(
                    f"s{a}-t2-{k}",
                    prompt + turn + tool + second + tool,
                    [vocab - 1, vocab - 2],
                    rng,
                    tools=True,
                    index=3 + k,
                )
            )
        rows += calls_to_rows(
            calls,
            advantage=a - (attempts - 1) / 2,
            attempt_id=f"syn-a{a}",
            group_id="syn",
            shared_prefix=shared_prefix,
        )
    return rows


def case_rows(case: str, *, max_prompt_tokens: int, seed: int = 0) -> list[TrainRow]:
    if case == "synthetic":
        return synthetic_group(seed=seed)
    rec = load_recorded(case, max_prompt_tokens=max_prompt_tokens)
    if case == "claude_code":
        return group_rows(rec, attempts=2, turns=8, rerender=True, seed=seed)
    return group_rows(rec, attempts=8, turns=4, rerender=False, seed=seed)


# ------------------------------------------------------------------------------ measurement


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def measure(
    model: str, case: str, path: str, *, runs: int, max_prompt_tokens: int, threads: int
) -> dict[str, Any]:
    """One optimizer step on the case's rows, timed ``runs`` times after a warm-up step (this
    process only: run it in a fresh process for the memory figure)."""
    import tempfile

    import torch

    torch.set_num_threads(threads)
    from fineenvs.train.grpo import CapturedGRPOTrainer
    from fineenvs.train.grpo_config import GRPOSettings
    from fineenvs_recipes.tiny import ensure_tiny_model

    rows = case_rows(case, max_prompt_tokens=max_prompt_tokens)
    settings = GRPOSettings(
        prefix_sharing=path, per_device_batch_size=4, learning_rate=1e-6, max_steps=runs + 1,
        token_budget=1 << 20, dtype="float32", gradient_checkpointing=False,
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="fineenvs-bench-trainer-") as out:
        trainer = CapturedGRPOTrainer(ensure_tiny_model(model), settings, Path(out))
        base = _rss_bytes()
        trainer.step(rows[:2])  # warm-up: first-call costs (kernels, AdamW state), not timed
        first: dict[str, float] = {}
        wall, cpu = [], []
        for _ in range(runs):
            t0, c0 = time.perf_counter(), time.process_time()
            metrics = trainer.step(rows)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            first = first or metrics
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "model": model,
        "case": case,
        "path": path,
        "rows": len(rows),
        "attempts": len({r.attempt_id for r in rows}),
        "tokens": first["train/tokens"],
        "tokens_unique": first["train/tokens_unique"],
        "tokens_forwarded": first["train/tokens_forwarded"],
        "loss": first["train/loss"],
        "wall_s": statistics.median(wall),
        "cpu_s": statistics.median(cpu),
        "peak_added_bytes": peak - base,
    }


def _run_worker(args: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.trainer", "--worker", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]
    out: dict[str, Any] = json.loads(line)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks trainer", description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-prompt-tokens", type=int, default=2048)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per measurement (1: on a shared machine, OpenMP barriers with busy "
        "neighbours measure scheduling stalls, worst for many small operations)",
    )
    p.add_argument("--worker", nargs=3, metavar=("MODEL", "CASE", "PATH"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.runs < 1 or args.threads < 1 or args.max_prompt_tokens < 2 * TASK_TOKENS:
        p.error(f"--runs and --threads must be >= 1 and --max-prompt-tokens >= {2 * TASK_TOKENS}")
    if args.worker:
        model, case, path = args.worker
        figures = measure(
            model, case, path, runs=args.runs, max_prompt_tokens=args.max_prompt_tokens, threads=args.threads
        )
        print(json.dumps(figures))
        return 0
    models = [m for m in args.models.split(",") if m]
    cases = [c for c in args.cases.split(",") if c]
    for c in cases:
        if c not in CASES:
            p.error(f"unknown case {c!r}; known: {', '.join(CASES)}")
    print(
        f"one optimizer step per case (median of {args.runs} runs after a warm-up step; prompts cut to "
        f"{args.max_prompt_tokens} tokens, {args.threads} torch thread(s)); speedup = padded / shared "
        "wall time, cpu x the same for process CPU time; memory = peak resident size added by the steps, "
        "one process per measurement"
    )
    header = (
        f"{'model':<13} {'case':<15} {'rows':>4} {'tokens':>7} {'unique':>7} {'fwd/uniq pad':>12} "
        f"{'fwd/uniq sh':>11} {'wall pad':>9} {'wall sh':>8} {'speedup':>7} {'cpu x':>6} "
        f"{'mem pad MB':>10} {'mem sh MB':>9} {'mem ratio':>9} {'loss rel diff':>13}"
    )
    print(header)
    for model in models:
        for case in cases:
            common = ["--runs", str(args.runs), "--max-prompt-tokens", str(args.max_prompt_tokens)]
            common += ["--threads", str(args.threads)]
            pad = _run_worker([model, case, "padded", *common])
            sh = _run_worker([model, case, "shared", *common])
            loss_diff = abs(pad["loss"] - sh["loss"]) / max(abs(pad["loss"]), 1e-12)
            print(
                f"{model:<13} {case:<15} {pad['rows']:>4} {int(pad['tokens']):>7} {int(pad['tokens_unique']):>7} "
                f"{pad['tokens_forwarded'] / pad['tokens_unique']:>12.2f} "
                f"{sh['tokens_forwarded'] / sh['tokens_unique']:>11.3f} "
                f"{pad['wall_s']:>8.2f}s {sh['wall_s']:>7.2f}s {pad['wall_s'] / sh['wall_s']:>6.2f}x "
                f"{pad['cpu_s'] / sh['cpu_s']:>5.2f}x "
                f"{pad['peak_added_bytes'] / 2**20:>10.0f} {sh['peak_added_bytes'] / 2**20:>9.0f} "
                f"{sh['peak_added_bytes'] / max(pad['peak_added_bytes'], 1):>9.2f} {loss_diff:>13.1e}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
