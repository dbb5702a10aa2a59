"""Why a job stopped: every job's errors in one place, so no job imports another for them.

``RunAborted`` is what the job runner (``fineenvs.jobs.run_job``) prints without a traceback and
turns into exit status 5; the others are raised inside a job and say what to fix.
"""

from __future__ import annotations


class RunAborted(RuntimeError):
    """The run cannot make progress; the message says why and what to check."""


class EvalError(ValueError):
    """The evaluation cannot start; the message says what to fix."""


class CollectionAborted(RuntimeError):
    """Too many ungraded attempts in a row: the engine, proxy or agents are broken, not the teacher."""


class StageFailed(RuntimeError):
    """A stage of the mini-reproduction exited non-zero; the message holds its log's last lines."""


__all__ = ["CollectionAborted", "EvalError", "RunAborted", "StageFailed"]
