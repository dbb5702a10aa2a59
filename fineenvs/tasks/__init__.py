"""Task sets, the grader, and the fixed training subset.

    from fineenvs.tasks import load_tasks, training_subset, grade_workdir, materialize_inputs

    tasks = load_tasks("demo", split="train")                       # offline, generated from a seed
    tasks = load_tasks("mini", split="eval", seed=MINI_SEED)        # the learnable held-out set
    tasks = load_tasks("smoldataenvs", split="test", path="/data/SmolDataEnvs-harbor")   # local copy
    tasks = load_tasks("smoldataenvs", split="train", revision="<sha>")   # Hub (needs network)
    subset = training_subset(load_tasks("smoldataenvs", split="train", path=...))   # 400 + 600

CLI: ``python -m fineenvs.tasks list tasks=demo`` (see ``__main__.py``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from fineenvs.tasks.demo import DEMO_SEED, ensure_demo, generate_demo
from fineenvs.tasks.grader import Grade, grade, grade_workdir
from fineenvs.tasks.mini import MINI_SEED, ensure_mini
from fineenvs.tasks.model import (
    ANSWER_FILE,
    ANSWER_TYPES,
    DIFFICULTIES,
    HiddenAnswer,
    Task,
    TaskError,
    materialize_inputs,
)
from fineenvs.tasks.smoldataenvs import SPLITS, TaskSetUnavailableError, load_hub, load_local

TASK_SETS = ("demo", "mini", "smoldataenvs")
TRAIN_SUBSET_SALT = "fineenvs-train-1000-v1"
TRAIN_SUBSET_MEDIUM = 400
TRAIN_SUBSET_HARD = 600


@dataclass(frozen=True)
class TrainingSubset:
    """A fixed training subset: how many tasks of each tier (``training_subset``'s rule picks which).
    The named ones (``published_1000``, ``qwen_1000``) are ``tasks.subsets`` in ``conf/tasks/``."""

    name: str
    easy: int = 0
    medium: int = 0
    hard: int = 0


__all__ = [
    "ANSWER_FILE",
    "DEMO_SEED",
    "MINI_SEED",
    "TASK_SETS",
    "Grade",
    "HiddenAnswer",
    "Task",
    "TaskError",
    "TaskFilter",
    "TaskSetUnavailableError",
    "ensure_demo",
    "ensure_mini",
    "generate_demo",
    "grade",
    "grade_workdir",
    "load_tasks",
    "load_training_subset",
    "materialize_inputs",
    "TrainingSubset",
    "training_subset",
]


@dataclass(frozen=True)
class TaskFilter:
    """Keep tasks matching every given criterion (None = no constraint)."""

    difficulties: tuple[str, ...] | None = None
    answer_types: tuple[str, ...] | None = None
    task_ids: tuple[str, ...] | None = None
    exclude_task_ids: tuple[str, ...] = ()
    require_inputs: bool = False  # drop tasks whose input files are not available locally

    def __post_init__(self) -> None:
        for value in self.difficulties or ():
            if value not in DIFFICULTIES:
                raise TaskError(f"filter difficulty {value!r} is not one of {DIFFICULTIES}")
        for value in self.answer_types or ():
            if value not in ANSWER_TYPES:
                raise TaskError(f"filter answer type {value!r} is not one of {ANSWER_TYPES}")

    def keep(self, task: Task) -> bool:
        return (
            (self.difficulties is None or task.difficulty in self.difficulties)
            and (self.answer_types is None or task.hidden.answer_type in self.answer_types)
            and (self.task_ids is None or task.task_id in self.task_ids)
            and task.task_id not in self.exclude_task_ids
            and (not self.require_inputs or bool(task.metadata.get("inputs_local", True)))
        )


def load_tasks(
    name: str,
    *,
    split: str = "train",
    path: str | Path | None = None,
    revision: str | None = None,
    limit: int | None = None,
    filters: TaskFilter | None = None,
    layout: str | None = None,
    seed: int = DEMO_SEED,
    subset: TrainingSubset | None = None,
) -> list[Task]:
    """Load a task set: "demo" (offline, generated from `seed` into the cache unless `path` points at
    a generated copy) or "smoldataenvs" (local `path` in Harbor or row layout, else the Hub).

    ``subset`` (train split only; e.g. ``published_1000``: 400 medium + 600 hard, from
    ``conf/tasks/smoldataenvs.yaml``) selects `training_subset` in its fixed order.
    Then filters apply, then `limit`; otherwise the order is the source's (task id order for
    Harbor layouts).
    """
    if subset is not None and split != "train":
        raise TaskError(f"subset={subset.name!r} is a training subset; it needs split='train', not {split!r}")
    if name not in TASK_SETS:
        raise TaskError(
            f"unknown task set {name!r}; choose one of {TASK_SETS} (tasks=demo, tasks=mini or tasks=smoldataenvs)"
        )
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise TaskError(f"limit={limit!r} must be a non-negative integer or None")
    if name == "demo":
        if revision is not None:
            raise TaskError("the demo set is generated locally; it has no revision (drop tasks.revision)")
        root = Path(path) if path is not None else ensure_demo(seed)
        tasks = load_local(root, split=split, layout="harbor")
    elif name == "mini":
        if revision is not None:
            raise TaskError("the mini set is generated locally; it has no revision (drop tasks.revision)")
        root = Path(path) if path is not None else ensure_mini(seed)
        tasks = load_local(root, split=split, layout="harbor")
    elif path is not None:
        tasks = load_local(Path(path), split=split, layout=layout)
    else:
        tasks = load_hub(split=split, revision=revision, layout=layout or "harbor")
    if subset is not None:
        tasks = training_subset(tasks, n_easy=subset.easy, n_medium=subset.medium, n_hard=subset.hard)
    if filters is not None:
        tasks = [t for t in tasks if filters.keep(t)]
    return tasks if limit is None else tasks[:limit]


def subset_key(task_id: str, salt: str = TRAIN_SUBSET_SALT) -> str:
    return hashlib.sha256(f"{salt}:{task_id}".encode()).hexdigest()


def training_subset(
    tasks: list[Task],
    *,
    n_easy: int = 0,
    n_medium: int = TRAIN_SUBSET_MEDIUM,
    n_hard: int = TRAIN_SUBSET_HARD,
    salt: str = TRAIN_SUBSET_SALT,
) -> list[Task]:
    """The fixed training subset (default 400 medium + 600 hard) in its fixed order.

    Rule (ours; the published run's exact selection is not public): rank every task by
    ``sha256(f"{salt}:{task_id}")``; take the first `n_medium` medium and the first `n_hard` hard
    tasks in that ranking; the subset's order is that same ranking. It depends only on the task
    ids (and their tiers), so every run, machine and loading order gets the same 1,000 tasks in
    the same order; a changed pool changes the subset only where a new task ranks in.
    """
    chosen: list[Task] = []
    for tier, count in (("easy", n_easy), ("medium", n_medium), ("hard", n_hard)):
        if count == 0:
            continue
        pool = sorted((t for t in tasks if t.difficulty == tier), key=lambda t: subset_key(t.task_id, salt))
        if len(pool) < count:
            raise TaskError(
                f"the training subset needs {count} {tier} tasks but the pool has {len(pool)}; load the full "
                "train split (tasks.split=train, no filters or limit) or lower the count"
            )
        chosen.extend(pool[:count])
    ids = [t.task_id for t in chosen]
    if len(set(ids)) != len(ids):
        raise TaskError("duplicate task ids in the pool; the training subset needs unique ids")
    return sorted(chosen, key=lambda t: subset_key(t.task_id, salt))


def load_training_subset(
    name: str = "smoldataenvs",
    *,
    path: str | Path | None = None,
    revision: str | None = None,
    layout: str | None = None,
    n_medium: int = TRAIN_SUBSET_MEDIUM,
    n_hard: int = TRAIN_SUBSET_HARD,
) -> list[Task]:
    """`training_subset` of the full train split of a task set."""
    tasks = load_tasks(name, split="train", path=path, revision=revision, layout=layout)
    return training_subset(tasks, n_medium=n_medium, n_hard=n_hard)


__all__ += ["SPLITS", "load_hub", "load_local", "subset_key"]
