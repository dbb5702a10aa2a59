"""The deterministic rollout schedule: which task, which harness, which attempt ids, in what order.

Passes go over the task list in its fixed order; each task becomes one group of ``group_size``
attempts that all use the same harness (the advantage then compares actions, not harnesses). The
harness of group ``i`` in pass ``p`` is the published rotation ``harnesses[(i + p) % n]``, a
deterministic weighted draw seeded by ``(seed, p, i)``, or ``shuffled``: every block of ``n``
consecutive groups has each harness once, in an order seeded by ``(seed, p, block)``. The rotation
ties a harness to the task index mod ``n``, so a task list that repeats a pattern with a period
sharing a factor with ``n`` (the mini tasks cycle three question templates) gives each harness one
kind of task only; ``shuffled`` keeps the rotation's balance without that. Ids are stable strings
derived from the position (``p0-t0003-opencode``), so a resumed run can tell which groups it already
trained on; ``schedule_hash`` fingerprints the whole schedule and a resume with a different one is
refused.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class PlannedGroup:
    index: int
    """Position in the schedule (0-based over all passes)."""
    group_id: str
    pass_index: int
    task_index: int
    task_id: str
    harness: str
    attempt_ids: tuple[str, ...]


@dataclass(frozen=True)
class HarnessMix:
    names: tuple[str, ...]
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.names:
            raise ValueError("the harness mix is empty: give at least one harness (harness=opencode)")
        if len(self.names) != len(self.weights):
            raise ValueError("harness mix: one weight per harness")
        if any(w <= 0 for w in self.weights):
            raise ValueError(f"harness mix weights must be > 0 (got {self.weights})")


def build_schedule(
    task_ids: list[str],
    mix: HarnessMix,
    *,
    group_size: int,
    passes: int,
    selection: str = "rotation",
    seed: int = 0,
) -> list[PlannedGroup]:
    """All groups of the run, in the order they are started."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1 (got {group_size})")
    if not task_ids:
        # A run never gets here with none: select_tasks refuses an empty selection.
        raise ValueError("build_schedule needs at least one task id")
    if len(set(task_ids)) != len(task_ids):
        raise ValueError("task ids must be unique within a schedule")
    if selection not in ("rotation", "weighted", "shuffled"):
        raise ValueError(f"harness selection must be rotation, weighted or shuffled (got {selection!r})")
    groups: list[PlannedGroup] = []
    n = len(mix.names)
    for p in range(passes):
        for i, task_id in enumerate(task_ids):
            if selection == "rotation":
                harness = mix.names[(i + p) % n]
            elif selection == "shuffled":
                order = random.Random(f"{seed}:{p}:block{i // n}").sample(mix.names, n)
                harness = order[i % n]
            else:
                rng = random.Random(f"{seed}:{p}:{i}")
                harness = rng.choices(mix.names, weights=mix.weights, k=1)[0]
            gid = f"p{p}-t{i:05d}-{harness}"
            attempts = tuple(f"{gid}-a{a}" for a in range(group_size))
            groups.append(PlannedGroup(len(groups), gid, p, i, task_id, harness, attempts))
    return groups


def schedule_hash(groups: list[PlannedGroup]) -> str:
    """sha256 of the schedule's content (ids, tasks, harnesses, order)."""
    payload = json.dumps([asdict(g) for g in groups], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()
