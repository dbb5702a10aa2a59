"""Job dispatch: ``job=rl|sft|collect_teacher|eval`` → the function that runs it."""

from __future__ import annotations

import sys

from fineenvs.config import Job, RunConfig


def run_job(run: RunConfig) -> float | None:
    """Run the configured job; returns the sweep objective (mean reward or pass@1) when there is one."""
    if run.job is Job.rl:
        from fineenvs.rl import RunAborted, run_rl

        try:
            return run_rl(run)
        except RunAborted as err:
            print(f"fineenvs: run aborted: {err}", file=sys.stderr)
            raise SystemExit(5) from None
    print(
        f"fineenvs: job={run.job.value} is not available in this build yet; only dry_run=true works for it. "
        "See README, 'Current limitations'.",
        file=sys.stderr,
    )
    raise SystemExit(4)
