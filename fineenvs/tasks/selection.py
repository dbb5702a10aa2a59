"""The tasks a run's ``tasks`` settings select: the one loader the jobs and the dry run share."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fineenvs.tasks import TaskError, TaskFilter, TrainingSubset, load_tasks

if TYPE_CHECKING:
    from fineenvs.config import TasksSpec
    from fineenvs.tasks.model import Task


def select_tasks(spec: TasksSpec, split: str | None = None) -> list[Task]:
    """``spec``'s tasks of ``split`` (default ``spec.split``) in their fixed order: filters, then the
    training subset, then ``spec.limit``. An empty selection is refused with the settings that caused it."""
    split = split or spec.split
    filters = TaskFilter(difficulties=tuple(spec.difficulties)) if spec.difficulties else None
    subset = None
    if split == "train" and spec.subset is not None:
        counts = spec.subsets[spec.subset]
        subset = TrainingSubset(spec.subset, counts.easy, counts.medium, counts.hard)
    tasks = load_tasks(
        spec.name, split=split, path=spec.path, revision=spec.revision, filters=filters, seed=spec.seed,
        subset=subset, limit=spec.limit,
    )  # fmt: skip
    if not tasks:
        chosen = f"difficulties={list(spec.difficulties)}, subset={spec.subset}, limit={spec.limit}"
        raise TaskError(
            f"tasks={spec.name} selects no task of split {split!r} ({chosen}): there is nothing to attempt. "
            "Fix: widen tasks.difficulties, raise tasks.limit (or eval.limit), or choose a split the set has "
            "(tasks.split, eval.split)"
        )
    return tasks
