"""Job dispatch: ``job=rl|sft|collect_teacher|eval`` → the function that runs it."""

from __future__ import annotations

import sys

from fineenvs.config import RunConfig


def run_job(run: RunConfig) -> float | None:
    """Run the configured job; returns the sweep objective (final reward or pass@1) when there is one."""
    print(
        f"fineenvs: job={run.job.value} is not available in this build yet; only dry_run=true works. "
        "See README, 'Current limitations'.",
        file=sys.stderr,
    )
    raise SystemExit(4)
