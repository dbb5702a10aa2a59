"""Job dispatch: ``job=rl|sft|collect_teacher|eval|recipe`` → the function that runs it."""

from __future__ import annotations

import sys
from collections.abc import Callable

from fineenvs.config import Job, RunConfig


def _runner(job: Job) -> Callable[[RunConfig], float | None]:
    if job is Job.rl:
        from fineenvs.jobs.rl import run_rl

        return run_rl
    if job is Job.collect_teacher:
        from fineenvs.jobs.teacher import run_collect_teacher

        return run_collect_teacher
    if job is Job.sft:
        from fineenvs.jobs.sft import run_sft

        return run_sft
    if job is Job.recipe:
        from fineenvs.jobs.recipe import run_recipe

        return run_recipe
    from fineenvs.jobs.eval import run_eval

    return run_eval


def run_job(run: RunConfig) -> float | None:
    """Run the configured job; returns the sweep objective (mean reward or pass@1) when there is one."""
    from fineenvs.engine.devices import DeviceError
    from fineenvs.jobs.builders import apply_trainer_devices
    from fineenvs.jobs.errors import RunAborted

    try:
        trainer_gpus = apply_trainer_devices(run)  # before anything starts CUDA in this process
    except DeviceError as err:
        print(f"fineenvs: cannot split the GPUs: {err}", file=sys.stderr)
        raise SystemExit(3) from None
    if trainer_gpus is not None:
        print(f"trainer GPUs: CUDA_VISIBLE_DEVICES={trainer_gpus}", flush=True)
    try:
        runner = _runner(run.job)
    except ImportError as err:
        print(f"fineenvs: job={run.job.value} is not available in this build ({err}).", file=sys.stderr)
        raise SystemExit(4) from None
    try:
        return runner(run)
    except RunAborted as err:
        print(f"fineenvs: run aborted: {err}", file=sys.stderr)
        raise SystemExit(5) from None
