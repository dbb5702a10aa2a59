"""The task model: what the agent sees (instruction, input files) and what it never sees (the answer).

A `Task` is split in two on purpose. `instruction`, `input_files` and `difficulty` describe the
agent's side; `hidden` holds the gold answer and how to grade it. `materialize_inputs` is the only
function that writes task material into a sandbox, and it copies `input_files` and nothing else, so
the gold answer cannot reach the agent through the task object. `hidden` is also left out of the
dataclass repr, so logging a task never prints its answer.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from fineenvs.jsonl import JsonObject

ANSWER_FILE = "answer.txt"

DIFFICULTIES = ("easy", "medium", "hard")

# The answer types of SmolDataEnvs (numeric, short label, list, free-form, yes/no, csv-list), plus
# "percentage", which the demo set uses for numbers that carry a percent sign.
ANSWER_TYPES = ("number", "label", "list", "csv_list", "yes_no", "percentage", "free_form")

# How a prediction is compared. "auto" runs the whole ladder (exact, numeric, list/percent,
# symbolic); the others name the rung the task was authored for, and the grader still accepts an
# exact match first. "ordered_list" is a list whose order matters.
MATCH_MODES = ("auto", "exact", "numeric", "list", "ordered_list", "percent", "yes_no", "symbolic")


class TaskError(ValueError):
    """A task (or task set) is malformed; the message says which one and how to fix it."""


@dataclass(frozen=True)
class HiddenAnswer:
    """The grading side of a task. Never written into a sandbox.

    Numeric predictions match when ``|pred - gold| <= max(atol, rtol * |gold|)``.
    """

    gold: str
    answer_type: str = "label"
    match_mode: str = "auto"
    atol: float = 0.0
    rtol: float = 1e-6

    def __post_init__(self) -> None:
        if self.answer_type not in ANSWER_TYPES:
            raise TaskError(
                f"answer_type={self.answer_type!r} is not one of {ANSWER_TYPES}; "
                "set it in the task's [metadata] (answer_type = ...) or leave it out to infer it"
            )
        if self.match_mode not in MATCH_MODES:
            raise TaskError(f"match_mode={self.match_mode!r} is not one of {MATCH_MODES}")
        for name in ("atol", "rtol"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or math.isnan(value) or value < 0:
                raise TaskError(f"{name}={value!r} must be a number >= 0 (a tolerance)")

    def __repr__(self) -> str:
        # Keep the gold answer out of logs and tracebacks by default.
        return (
            f"HiddenAnswer(gold=<hidden>, answer_type={self.answer_type!r}, "
            f"match_mode={self.match_mode!r}, atol={self.atol}, rtol={self.rtol})"
        )


@dataclass(frozen=True)
class Task:
    """One task: the agent's side plus the hidden grading side (`hidden`)."""

    task_id: str
    instruction: str
    input_files: dict[str, Path]
    difficulty: str
    hidden: HiddenAnswer = field(repr=False)
    metadata: JsonObject = field(default_factory=dict)
    environment: Path | None = None
    """The task's environment folder (a ``Dockerfile`` inside, never the grader): its container
    image under ``scheduler.sandbox=docker``; ignored by the other sandboxes."""

    def __post_init__(self) -> None:
        if not self.task_id or "/" in self.task_id or self.task_id in (".", ".."):
            raise TaskError(f"task_id={self.task_id!r} must be a non-empty name without '/'")
        if self.difficulty not in DIFFICULTIES:
            raise TaskError(
                f"task {self.task_id}: difficulty={self.difficulty!r} is not one of {DIFFICULTIES}"
            )
        for name in self.input_files:
            check_input_name(self.task_id, name)


def check_input_name(task_id: str, name: str) -> None:
    """Input names are relative POSIX paths inside the sandbox; refuse escapes and the answer file."""
    path = PurePosixPath(name)
    if not name or path.is_absolute() or ".." in path.parts or "\\" in name:
        raise TaskError(
            f"task {task_id}: input file name {name!r} must be a relative path inside the sandbox "
            "(no leading '/', no '..')"
        )
    if path.as_posix() == ANSWER_FILE:
        raise TaskError(
            f"task {task_id}: an input file may not be named {ANSWER_FILE!r}; that is where the "
            "agent writes its answer"
        )


def materialize_inputs(task: Task, workdir: Path) -> list[Path]:
    """Copy the task's input files (and only them) into `workdir`; return the written paths.

    Missing sources raise `TaskError` naming the task and the file, because a sandbox without
    its data would turn every attempt into a silent wrong answer.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name, source in sorted(task.input_files.items()):
        check_input_name(task.task_id, name)
        source = Path(source)
        target = workdir / PurePosixPath(name)
        if not source.exists():
            raise TaskError(
                f"task {task.task_id}: input file {name!r} is missing at {source}; "
                "re-download or regenerate the task set"
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, dirs_exist_ok=True)
        else:
            shutil.copyfile(source, target)
        written.append(target)
    return written
