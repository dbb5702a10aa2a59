"""Evaluation: pass@1 of checkpoints across harnesses, tool-call and token statistics, results.json.

A *cell* is one (checkpoint, task, harness). Each cell gets one attempt; its result is the first
**graded** attempt (published: pass@1 on the first graded attempt). An attempt that failed for
infrastructure reasons — reward ``None`` (ungraded), a wiring failure (the agent never reached the
model), or a crash/timeout that left no ``answer.txt`` — is retried up to ``eval.infra_retries``
times; a graded attempt is never re-run, also not when it was wrong. A cell still ungraded after
its retries counts as unsolved in pass@1 (the denominator is always every task) and is reported
under ``ungraded``, so infrastructure trouble lowers the score visibly instead of silently
shrinking the denominator.

Every attempt is appended to ``<output_dir>/eval/attempts.jsonl`` as it finishes; results are
recomputed from that file, so re-running with the same output directory skips graded cells and
retries only the ungraded ones (with a fresh retry budget), and a checkpoint whose cells are all
graded does not even start an engine.

The results maths (pass@1, co-solved tool calls, the tables) is ``fineenvs.results``.

Tool-call reduction on co-solved tasks (published: multi-harness RL "31% fewer tool calls on tasks
both solved"): the first checkpoint is the baseline; for each other checkpoint, the cells
(task, harness) solved by both with a tool count on both; reduction = 1 - mean(other) /
mean(baseline) over those cells.

``results.json`` (read by ``fineenvs.report``)::

    {"schema": 1, "split": ..., "tasks": n, "harnesses": [...], "checkpoints": [...],
     "baseline": <first checkpoint>,
     "pass_at_1": {ckpt: {harness: float}}, "overall": {ckpt: float},
     "tool_call_reduction": {"<ckpt> vs <baseline>": float},
     "co_solved": {"<ckpt> vs <baseline>": {"cells": n, "mean_tool_calls": {...}, "reduction": ...,
                   "per_harness": {h: {...}}}},
     "paired": {"<ckpt> vs <baseline>": {"won": n, "lost": n, "p": float, "per_harness": {h: {...}}}},
     "cells": {ckpt: {harness: CellStats}}, "steps": {ckpt: step}}
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import logging
import re
from collections import defaultdict
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, ParamSpec, TypeVar

from fineenvs.config import EngineKind, ModelSource, RunConfig
from fineenvs.jobs.builders import resolve_model_dir
from fineenvs.jobs.errors import EvalError, RunAborted
from fineenvs.jobs.runtime import attempt_runner, check_harnesses, job_runtime
from fineenvs.jsonl import JsonObject
from fineenvs.metrics import MetricLogger
from fineenvs.proxy.upstream import derived_seed
from fineenvs.results import (
    EvalAttempt,
    append_attempt,
    compute_results,
    eval_metrics,
    first_graded,
    format_tables,
    label,
    read_attempts,
    write_results,
)
from fineenvs.rollout.attempt import ProxyAttemptRunner
from fineenvs.rollout.schedule import PlannedGroup
from fineenvs.rollout.scheduler import AttemptOutcome, AttemptPool, AttemptRunner
from fineenvs.tasks.selection import select_tasks
from fineenvs.trajectory import Row, RowOptions
from fineenvs.trajectory.record import CallRecord

if TYPE_CHECKING:
    from fineenvs.rollout.ray_backend import RayAttempts
    from fineenvs.tasks.model import Task

log = logging.getLogger("fineenvs.jobs.eval")

BASE = "base"
"""``eval.checkpoints`` entry meaning the model under ``model`` (e.g. ``[base,outputs/.../step-700]``)."""


# --------------------------------------------------------------------------- running cells


class EvalAttemptRunner(ProxyAttemptRunner):
    """The RL attempt runner without training rows: token accounting from the proxy's records
    instead, and whether the agent left an answer (a crash or timeout without one is retried)."""

    common_seed: int | None = None
    """Set (``eval.common_random_numbers``: the run's seed): each cell's sessions get a sampling
    seed from this, the task, the harness and the try, the same for every checkpoint."""

    def sampling_seed(self, group: PlannedGroup, attempt_id: str) -> int | None:
        if self.common_seed is None:
            return None
        return cell_seed(
            self.common_seed, group.task_id, group.harness, attempt_id.removeprefix(group.group_id)
        )

    def _rows(self, calls: list[CallRecord], outcome: AttemptOutcome) -> tuple[list[Row], dict[str, float]]:
        return [], {
            "prompt_tokens": float(sum(len(c["prompt_ids"]) for c in calls)),
            "completion_tokens": float(sum(len(c["sampled_ids"]) for c in calls)),
            "cut_off_calls": float(sum(1 for c in calls if c["finish_reason"] == "length")),
        }

    async def __call__(self, group: PlannedGroup, attempt_index: int, policy_version: int) -> AttemptOutcome:
        outcome = await super().__call__(group, attempt_index, policy_version)
        answer = self.settings.attempts_dir / group.group_id / outcome.attempt_id / "work" / "answer.txt"
        outcome.metrics["answered"] = float(answer.is_file())
        return outcome


def cell_seed(run_seed: int, task_id: str, harness: str, attempt: str) -> int:
    """The proxy session seed of one cell's attempt (``attempt``: which try, e.g. ``-try0``): a
    checkpoint's draws on a cell are the same as every other checkpoint's; cells, tries and run
    seeds get unrelated ones."""
    return derived_seed(run_seed, task_id, harness, attempt)


def _record(checkpoint: str, try_index: int, outcome: AttemptOutcome, step: int | None) -> EvalAttempt:
    m = outcome.metrics
    return EvalAttempt(
        checkpoint=checkpoint,
        task_id=outcome.task_id,
        harness=outcome.harness,
        try_index=try_index,
        attempt_id=outcome.attempt_id,
        reward=outcome.reward,
        exit_reason=outcome.exit_reason,
        answered=bool(m.get("answered", 0.0)),
        tool_calls=outcome.tool_calls,
        model_calls=outcome.model_calls,
        prompt_tokens=int(m.get("prompt_tokens", 0)),
        completion_tokens=int(m.get("completion_tokens", 0)),
        cut_off_calls=int(m.get("cut_off_calls", 0)),
        duration_seconds=round(outcome.duration_seconds, 3),
        error=outcome.error,
        step=step,
    )


async def run_cells(
    runner: AttemptRunner,
    *,
    checkpoint: str,
    task_ids: Sequence[str],
    harnesses: Sequence[str],
    prior: Sequence[EvalAttempt],
    infra_retries: int,
    concurrency: int,
    sink: Callable[[EvalAttempt], None],
    policy_version: int = 0,
    step: int | None = None,
) -> list[EvalAttempt]:
    """Run every cell of ``checkpoint`` that has no graded attempt in ``prior``: one attempt, then up
    to ``infra_retries`` more while attempts fail for infrastructure reasons. ``runner`` is an
    ``AttemptRunner`` (a raising runner counts as a crash). Each attempt goes to ``sink`` when it ends."""
    if concurrency < 1:
        raise EvalError(f"eval.concurrency must be >= 1 (got {concurrency}). Fix: eval.concurrency=35")
    if infra_retries < 0:
        raise EvalError(f"eval.infra_retries must be >= 0 (got {infra_retries}). Fix: eval.infra_retries=2")
    done: dict[tuple[str, str], list[EvalAttempt]] = defaultdict(list)
    for a in prior:
        if a.checkpoint == checkpoint:
            done[(a.task_id, a.harness)].append(a)
    pool = AttemptPool(runner, concurrency)
    new: list[EvalAttempt] = []

    async def one_cell(index: int, task_id: str, harness: str) -> None:
        earlier = done[(task_id, harness)]
        if first_graded(earlier) is not None:
            return
        start = max((a.try_index for a in earlier), default=-1) + 1
        gid = f"t{index:05d}-{harness}"
        for n in range(start, start + infra_retries + 1):
            group = PlannedGroup(index, gid, 0, index, task_id, harness, (f"{gid}-try{n}",))
            outcome = await pool.attempt(group, 0, policy_version)  # a crash is a value, retried
            rec = _record(checkpoint, n, outcome, step)
            sink(rec)
            new.append(rec)
            if not rec.infra_failure:
                return
            log.warning(
                "eval %s %s %s try %d: infra failure (%s)",
                checkpoint,
                task_id,
                harness,
                n,
                rec.error or rec.exit_reason,
            )

    await asyncio.gather(*(one_cell(i, t, h) for i, t in enumerate(task_ids) for h in harnesses))
    return new


# --------------------------------------------------------------------------- runtime assembly


def served_model_name(run: RunConfig) -> str:
    """The name the engine serves the base model under (kept when serving a checkpoint)."""
    return run.model.name if run.engine.kind is EngineKind.transformers else run.model.path


def resolve_checkpoints(run: RunConfig) -> list[tuple[str, RunConfig]]:
    """``eval.checkpoints`` as (results key, run whose ``model`` serves it). Empty: the base model."""
    entries = list(run.eval.checkpoints) or [BASE]
    out: list[tuple[str, RunConfig]] = []
    problems: list[str] = []
    for entry in entries:
        if entry == BASE:
            out.append((run.model.path, run))
            continue
        path = Path(entry).expanduser()
        if path.is_dir():
            if not (path / "config.json").is_file():
                problems.append(
                    f"eval.checkpoints entry {entry!r} is a directory without config.json: the engine loads "
                    "a Hugging Face model directory (a trainer checkpoint such as outputs/<run>/checkpoints/step-100)."
                )
                continue
            model = dataclasses.replace(
                run.model, source=ModelSource.local, path=str(path.resolve()), revision=None
            )
            out.append((entry, dataclasses.replace(run, model=model)))
        elif run.engine.kind is EngineKind.vllm and "/" in entry and not entry.startswith((".", "/")):
            # A Hub id, optionally @revision (published checkpoints: FineEnvs/...-RL@step-700).
            hub_id, _, revision = entry.partition("@")
            model = dataclasses.replace(
                run.model, source=ModelSource.hub, path=hub_id, revision=revision or None
            )
            out.append((entry, dataclasses.replace(run, model=model)))
        else:
            problems.append(
                f"eval.checkpoints entry {entry!r} is not a directory. Give checkpoint directories (or 'base' "
                "for the model under `model`), e.g. eval.checkpoints=[base,outputs/<run>/checkpoints/step-100]"
                + ("; Hub ids need engine=vllm" if run.engine.kind is EngineKind.transformers else "")
            )
    keys = [k for k, _ in out]
    if len(set(keys)) != len(keys):
        problems.append(
            f"eval.checkpoints lists the same checkpoint twice ({keys}); each is one row of the matrix."
        )
    if problems:
        raise EvalError("\n".join(problems))
    return out


def eval_tasks(run: RunConfig, limit: int | None) -> list[Task]:
    """The first ``limit`` tasks of ``eval.split`` (evaluation's limit replaces ``tasks.limit``)."""
    return select_tasks(dataclasses.replace(run.tasks, limit=limit), run.eval.split)


def _slug(checkpoint: str) -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", label(checkpoint)).strip("_")[-60:]
    return f"{name}-{hashlib.sha256(checkpoint.encode()).hexdigest()[:8]}"


def _check_harnesses(run: RunConfig) -> None:
    check_harnesses(run, EvalError)


async def _evaluate_served(
    run: RunConfig,
    *,
    checkpoint: str,
    out: Path,
    proxy_url: str,
    served: str,
    tasks: list[Task],
    records: Path,
    prior: list[EvalAttempt],
    policy_version: int = 0,
    step: int | None = None,
    remote: RayAttempts | None = None,
) -> list[EvalAttempt]:
    runner = attempt_runner(
        run,
        tasks,
        proxy_url=proxy_url,
        served_model=served,
        attempts_dir=out / "attempts",
        row_options=RowOptions(),
        runner_class=EvalAttemptRunner,
    )
    if remote is not None:  # scheduler.backend=ray: the cells' attempts run on the cluster
        runner.settings.remote = remote
    if run.eval.common_random_numbers and isinstance(runner, EvalAttemptRunner):
        runner.common_seed = run.seed
    try:
        return await run_cells(
            runner,
            checkpoint=checkpoint,
            task_ids=[t.task_id for t in tasks],
            harnesses=list(run.harness),
            prior=prior,
            infra_retries=run.eval.infra_retries,
            concurrency=run.eval.concurrency,
            sink=lambda a: append_attempt(records, a),
            policy_version=policy_version,
            step=step,
        )
    finally:
        await runner.aclose()


def _pending(prior: list[EvalAttempt], checkpoint: str, task_ids: list[str], harnesses: list[str]) -> int:
    by: dict[tuple[str, str], list[EvalAttempt]] = defaultdict(list)
    for a in prior:
        if a.checkpoint == checkpoint:
            by[(a.task_id, a.harness)].append(a)
    return sum(1 for t in task_ids for h in harnesses if first_graded(by[(t, h)]) is None)


async def _serve_and_evaluate(
    run: RunConfig,
    ckpt_run: RunConfig,
    *,
    checkpoint: str,
    out: Path,
    tasks: list[Task],
    records: Path,
    prior: list[EvalAttempt],
    engine_url: str | None = None,
    proxy_url: str | None = None,
    served: str | None = None,
    policy_version: int = 0,
    step: int | None = None,
    remote: RayAttempts | None = None,
) -> list[EvalAttempt]:
    """Start what is not given (engine on the checkpoint, proxy in front of it), then run the cells."""
    served = served or served_model_name(run)
    async with contextlib.AsyncExitStack() as stack:
        if proxy_url is None:
            rt = await stack.enter_async_context(
                job_runtime(
                    ckpt_run,
                    out,
                    model_dir=None if engine_url else resolve_model_dir(ckpt_run),
                    engine_url=engine_url,
                    served_model_name=served,
                    label=f"eval {checkpoint}",
                    check=False,  # checked once before the first checkpoint
                )
            )
            proxy_url, served, remote = rt.proxy_url, rt.engine.served_model_name, rt.remote
        return await _evaluate_served(
            run, checkpoint=checkpoint, out=out, proxy_url=proxy_url, served=served, tasks=tasks,
            records=records, prior=prior, policy_version=policy_version, step=step, remote=remote,
        )  # fmt: skip


def run_eval(run: RunConfig) -> float:
    """``job=eval``: every checkpoint x harness x task; writes ``eval/results.json``; returns the
    overall pass@1 of the last checkpoint (the sweep objective)."""
    try:
        return asyncio.run(_run_eval(run))
    except EvalError as err:
        raise RunAborted(f"evaluation cannot start: {err}") from None


async def _run_eval(run: RunConfig) -> float:
    root = Path(str(run.output_dir))
    out = root / "eval"
    checkpoints = resolve_checkpoints(run)
    tasks = eval_tasks(run, run.eval.limit)
    _check_harnesses(run)
    task_ids = [t.task_id for t in tasks]
    harnesses = list(run.harness)
    records = out / "attempts.jsonl"
    attempts = read_attempts(records)
    keys = [k for k, _ in checkpoints]
    print(
        f"eval: {len(keys)} checkpoint(s) x {len(harnesses)} harness(es) x {len(task_ids)} {run.eval.split} "
        f"tasks = {len(keys) * len(harnesses) * len(task_ids)} cells -> {out}",
        flush=True,
    )
    results: JsonObject = {}
    for i, (key, ckpt_run) in enumerate(checkpoints):
        pending = _pending(attempts, key, task_ids, harnesses)
        if pending:
            print(f"eval {key}: {pending} cell(s) to run", flush=True)
            attempts += await _serve_and_evaluate(
                run,
                ckpt_run,
                checkpoint=key,
                out=out / _slug(key),
                tasks=tasks,
                records=records,
                prior=attempts,
            )
        else:
            print(f"eval {key}: every cell already graded in {records}; skipped", flush=True)
        results = compute_results(
            attempts, checkpoints=keys[: i + 1], harnesses=harnesses, task_ids=task_ids, split=run.eval.split
        )
        write_results(out / "results.json", results)
        with MetricLogger(
            run.logger,
            out / _slug(key),
            run_name=f"eval-{label(key)}",
            # The run's config at top level (dashboards group by config.experiment) plus the checkpoint.
            config={**asdict(run), "eval_checkpoint": key},
        ) as logger:
            logger.log(eval_metrics(results, key), step=i)
    print("\n" + format_tables(results), flush=True)
    print(f"\nresults: {out / 'results.json'}", flush=True)
    return float(results["overall"][keys[-1]])


# --------------------------------------------------------------------------- in-training hook


def _step_of(key: str) -> int:
    m = re.fullmatch(r"step-(\d+)", key)
    return int(m.group(1)) if m else -1


async def aevaluate_checkpoint(
    run: RunConfig,
    checkpoint_dir: Path | str,
    step: int,
    *,
    engine_url: str | None = None,
    proxy_url: str | None = None,
    served_model: str | None = None,
    logger: MetricLogger | None = None,
    remote: RayAttempts | None = None,
) -> dict[str, float]:
    """Evaluate the policy of training step ``step`` on the first ``eval.subset_during_training``
    tasks of ``eval.split`` across ``run.harness``; returns (and logs to ``logger`` at ``step``)
    ``eval/pass_at_1`` and ``eval/harness/<h>/pass_at_1`` (plus tool calls, timeouts, ...).

    With ``proxy_url`` (and the engine behind it already serving step ``step``'s weights), the
    running engine and proxy are reused; with only ``engine_url`` a proxy is started in front of
    it; with neither, an engine is started on ``checkpoint_dir``. Results of every step so far
    accumulate in ``<output_dir>/eval/results.json`` (rows ``step-<N>``, baseline the first step).
    """
    root = Path(str(run.output_dir))
    out = root / "eval"
    limit = run.eval.subset_during_training
    if run.eval.limit is not None:
        limit = run.eval.limit if limit is None else min(limit, run.eval.limit)
    tasks = eval_tasks(run, limit)
    key = f"step-{step}"
    records = out / "attempts.jsonl"
    attempts = read_attempts(records)
    ckpt_run = run
    if engine_url is None and proxy_url is None:
        model = dataclasses.replace(
            run.model, source=ModelSource.local, path=str(checkpoint_dir), revision=None
        )
        ckpt_run = dataclasses.replace(run, model=model)
    attempts += await _serve_and_evaluate(
        run, ckpt_run, checkpoint=key, out=out / key, tasks=tasks, records=records, prior=attempts,
        engine_url=engine_url, proxy_url=proxy_url, served=served_model, policy_version=step, step=step,
        remote=remote,
    )  # fmt: skip
    keys = sorted({a.checkpoint for a in attempts if _step_of(a.checkpoint) >= 0}, key=_step_of)
    results = compute_results(
        attempts, checkpoints=keys, harnesses=list(run.harness), task_ids=[t.task_id for t in tasks],
        split=run.eval.split, steps={k: _step_of(k) for k in keys},
    )  # fmt: skip
    write_results(out / "results.json", results)
    metrics = eval_metrics(results, key)
    if logger is not None:
        logger.log(metrics, step=step)
    print(
        f"eval step {step}: pass@1 {metrics['eval/pass_at_1'] * 100:.1f}% on {len(tasks)} tasks x "
        f"{len(run.harness)} harness(es)",
        flush=True,
    )
    return metrics


P = ParamSpec("P")
R = TypeVar("R")


def _blocking(coroutine_fn: Callable[P, Coroutine[object, object, R]]) -> Callable[P, R]:
    """The blocking form of ``coroutine_fn``, for a thread or a script (not inside a running loop)."""

    @functools.wraps(coroutine_fn)
    def run_to_completion(*args: P.args, **kwargs: P.kwargs) -> R:
        return asyncio.run(coroutine_fn(*args, **kwargs))

    return run_to_completion


evaluate_checkpoint = _blocking(aevaluate_checkpoint)


__all__ = [
    "BASE",
    "EvalAttemptRunner",
    "EvalError",
    "aevaluate_checkpoint",
    "evaluate_checkpoint",
    "resolve_checkpoints",
    "run_cells",
    "run_eval",
]
