"""``job=collect_teacher``: the SFT baseline's teacher rollouts through the real harnesses.

Teacher collection runs the configured model (the teacher: a vLLM-served Qwen3.8-27B in the
published setup, any engine here, ``engine.url=`` attaches to one) through the same engine → proxy
→ real agent CLI → grader path as RL rollouts (``ProxyAttemptRunner``), on the training tasks. For
every task × harness it runs up to ``trainer.teacher_attempts_per_task`` attempts one after another
and keeps the first correct one (published: 3 attempts, 3,189 kept rollouts from 888 tasks). Pairs
run concurrently, at most ``scheduler.max_inflight`` attempts at a time. The proxy records every
call under ``<output_dir>/records`` exactly as in RL; ``attempts.jsonl`` has one line per attempt,
``teacher_pairs.jsonl`` one per finished pair (a rerun in the same directory skips those), and
``teacher_manifest.json`` lists the kept sessions (task, harness, session id, attempt dir) for
``job=sft`` (``fineenvs.jobs.sft``).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fineenvs.config import RunConfig
from fineenvs.jobs.builders import resolve_model_dir, row_options
from fineenvs.jobs.errors import CollectionAborted, RunAborted
from fineenvs.jobs.runtime import Probe, job_runtime
from fineenvs.jsonl import JsonObject, append_jsonl, read_jsonl
from fineenvs.metrics import write_summary
from fineenvs.plan import TEACHER_MANIFEST
from fineenvs.rollout.schedule import PlannedGroup
from fineenvs.rollout.scheduler import AttemptOutcome, AttemptPool, AttemptRunner
from fineenvs.tasks.selection import select_tasks
from fineenvs.train.sft_config import SFTSettings

PAIRS_LOG = "teacher_pairs.jsonl"


def teacher_pairs(
    task_ids: Sequence[str], harnesses: Sequence[str], attempts_per_task: int
) -> list[PlannedGroup]:
    """One planned group per task × harness (tasks in their fixed order), with its attempt ids."""
    if attempts_per_task < 1:
        # A run's trainer.teacher_attempts_per_task is checked at compose time (SFTSettings).
        raise ValueError(f"attempts_per_task must be >= 1, got {attempts_per_task}")
    if not task_ids:
        # A run never gets here with none: select_tasks refuses an empty selection.
        raise ValueError("teacher_pairs needs at least one task id")
    if not harnesses:
        raise ValueError("no harness configured: teacher collection needs at least one (harness=paper_mix)")
    groups: list[PlannedGroup] = []
    for i, task_id in enumerate(task_ids):
        for harness in harnesses:
            gid = f"teacher-t{i:05d}-{harness}"
            attempts = tuple(f"{gid}-a{k}" for k in range(attempts_per_task))
            groups.append(PlannedGroup(len(groups), gid, 0, i, task_id, harness, attempts))
    return groups


def is_correct(outcome: AttemptOutcome) -> bool:
    """Graded and fully correct (the correctness term is the grade; partial credit is not kept)."""
    correctness = outcome.reward_terms.get("correctness")
    return outcome.reward is not None and correctness is not None and correctness >= 1.0


@dataclass
class PairResult:
    group: PlannedGroup
    attempts: list[AttemptOutcome] = field(default_factory=list)

    @property
    def kept(self) -> AttemptOutcome | None:
        return next((a for a in self.attempts if is_correct(a)), None)

    @property
    def settled(self) -> bool:
        """A correct attempt, or every attempt graded: a rerun would not change this pair's answer.
        An ungraded attempt (timeout without an answer, crash, dead proxy) leaves it open."""
        return self.kept is not None or (
            len(self.attempts) == len(self.group.attempt_ids)
            and all(a.reward is not None for a in self.attempts)
        )


async def collect_pairs(
    groups: Sequence[PlannedGroup],
    runner: AttemptRunner,
    *,
    max_inflight: int,
    on_attempt: Callable[[AttemptOutcome], None] | None = None,
    on_pair: Callable[[PairResult], None] | None = None,
    max_consecutive_ungraded: int | None = None,
) -> list[PairResult]:
    """Run each pair's attempts in order until one is correct; at most ``max_inflight`` at once.

    A runner exception is an attempt outcome (``exit_reason="crashed"``), as in the RL scheduler:
    the pair moves on to its next attempt. After ``max_consecutive_ungraded`` ungraded attempts in
    a row no new attempt starts and ``CollectionAborted`` is raised once the running ones end.
    """
    pool = AttemptPool(runner, max_inflight)
    ungraded_run = [0]
    exits: Counter[str] = Counter()

    async def one(group: PlannedGroup) -> PairResult:
        result = PairResult(group)
        for index in range(len(group.attempt_ids)):
            if max_consecutive_ungraded is not None and ungraded_run[0] >= max_consecutive_ungraded:
                break
            outcome = await pool.attempt(group, index, 0)
            result.attempts.append(outcome)
            exits[outcome.exit_reason] += 1
            ungraded_run[0] = ungraded_run[0] + 1 if outcome.reward is None else 0
            if on_attempt is not None:
                on_attempt(outcome)
            if is_correct(outcome):
                break
        if on_pair is not None:
            on_pair(result)
        return result

    results = list(await asyncio.gather(*(one(g) for g in groups)))
    if max_consecutive_ungraded is not None and ungraded_run[0] >= max_consecutive_ungraded:
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(exits.items()))
        raise CollectionAborted(
            f"{ungraded_run[0]} attempts in a row were ungraded (attempt exits so far: {reasons}): the engine, "
            "the proxy or the agents are failing, not the teacher. Finished pairs are kept; fix the cause (see "
            "the agents' logs under attempts/ and proxy.log) and rerun in the same directory to continue."
        )
    return results


def _attempt_record(a: AttemptOutcome) -> JsonObject:
    rec = {k: v for k, v in asdict(a).items() if k != "rows"}
    rec["rows"] = len(a.rows)
    rec["correct"] = is_correct(a)
    return rec


def _pair_record(p: PairResult, attempts_dir: Path) -> JsonObject:
    kept = p.kept
    return {
        "group_id": p.group.group_id,
        "task": p.group.task_id,
        "harness": p.group.harness,
        "attempts": [a.attempt_id for a in p.attempts],
        "exit_reasons": [a.exit_reason for a in p.attempts],
        "kept_attempt": kept.attempt_id if kept else None,
        "attempt_dir": str(attempts_dir / p.group.group_id / kept.attempt_id) if kept else None,
        "reward": kept.reward if kept else None,
        "tool_calls": kept.tool_calls if kept else None,
        "model_calls": kept.model_calls if kept else None,
        "settled": p.settled,
    }


def _sessions_by_attempt(store_dir: Path) -> dict[str, str]:
    """attempt id → newest proxy session of that attempt (a rerun attempt gets a new session)."""
    from fineenvs.proxy.store import CallStore

    newest: dict[str, tuple[float, str]] = {}
    for meta in CallStore(store_dir, fsync=False).load_metas():
        attempt = (meta.get("metadata") or {}).get("attempt")
        if not attempt:
            continue
        created = float(meta.get("created_at") or 0.0)
        if attempt not in newest or created >= newest[attempt][0]:
            newest[attempt] = (created, str(meta["session_id"]))
    return {a: sid for a, (_, sid) in newest.items()}


def write_teacher_manifest(out: Path, store_dir: Path, teacher_model: str) -> JsonObject:
    """``teacher_manifest.json`` from the pairs log and the proxy store; returns the summary."""
    latest = {p["group_id"]: p for p in read_jsonl(out / PAIRS_LOG)}  # a rerun pair's newest line wins
    pairs = list(latest.values())
    sessions = _sessions_by_attempt(store_dir)
    kept: list[JsonObject] = []
    missing: list[str] = []
    for p in pairs:
        if not p["kept_attempt"]:
            continue
        sid = sessions.get(p["kept_attempt"])
        if sid is None:
            missing.append(p["kept_attempt"])
            continue
        kept.append(
            {
                "task": p["task"],
                "harness": p["harness"],
                "session_id": sid,
                "attempt_id": p["kept_attempt"],
                "attempt_dir": p["attempt_dir"],
                "reward": p["reward"],
                "tool_calls": p["tool_calls"],
                "model_calls": p["model_calls"],
            }
        )
    summary = teacher_summary(pairs, kept)
    summary["kept_without_session"] = missing
    manifest = {
        "teacher_model": teacher_model,
        "store_dir": str(store_dir.resolve()),
        "sessions": kept,
        "summary": summary,
    }
    (out / TEACHER_MANIFEST).write_text(json.dumps(manifest, indent=2))
    return summary


def teacher_summary(pairs: list[JsonObject], kept: list[JsonObject]) -> JsonObject:
    harnesses = sorted({p["harness"] for p in pairs})
    per: dict[str, JsonObject] = {}
    for h in harnesses:
        mine = [p for p in pairs if p["harness"] == h]
        got = [k for k in kept if k["harness"] == h]
        per[h] = {
            "tasks_tried": len(mine),
            "correct": len(got),
            "attempts": sum(len(p["attempts"]) for p in mine),
            "solve_rate": len(got) / len(mine) if mine else 0.0,
        }
    exits = Counter(r for p in pairs for r in p["exit_reasons"])
    return {
        "tasks_tried": len({p["task"] for p in pairs}),
        "pairs_tried": len(pairs),
        "attempts": sum(len(p["attempts"]) for p in pairs),
        "kept_rollouts": len(kept),
        "tasks_with_kept_rollout": len({k["task"] for k in kept}),
        "per_harness": per,
        "attempt_exits": dict(exits),
    }


def pending_pairs(groups: Sequence[PlannedGroup], out: Path) -> list[PlannedGroup]:
    """The pairs a (re)run in ``out`` still has to run: all but those settled in ``PAIRS_LOG``.

    A pending pair starts over from its first attempt, so its old attempt directories are removed:
    a work directory left by an interrupted attempt could hold a stale ``answer.txt``.
    """
    settled = {p["group_id"] for p in read_jsonl(out / PAIRS_LOG) if p.get("settled", True)}
    todo = [g for g in groups if g.group_id not in settled]
    for g in todo:
        shutil.rmtree(out / "attempts" / g.group_id, ignore_errors=True)
    return todo


def run_collect_teacher(run: RunConfig) -> float:
    return asyncio.run(_collect_teacher(run))


async def _collect_teacher(run: RunConfig) -> float:
    t, s = run.trainer, run.scheduler
    assert isinstance(t, SFTSettings) and "correctness" in run.reward.terms, "validate() requires both"
    out = Path(str(run.output_dir))
    out.mkdir(parents=True, exist_ok=True)
    tasks = select_tasks(run.tasks)
    groups = teacher_pairs([task.task_id for task in tasks], list(run.harness), t.teacher_attempts_per_task)
    attempts_dir = out / "attempts"
    todo = pending_pairs(groups, out)
    done = len(groups) - len(todo)
    store_dir = Path(run.proxy.store_dir) if run.proxy.store_dir else out / "records"
    started = time.monotonic()
    print(
        f"Teacher collection: {len(tasks)} tasks x {len(run.harness)} harnesses = {len(groups)} pairs "
        f"({done} already settled), up to {t.teacher_attempts_per_task} attempts each",
        flush=True,
    )
    # Any probe grade will do: SFT re-renders the teacher's messages with the student's template.
    async with job_runtime(run, out, model_dir=resolve_model_dir(run), probe=Probe.inform) as rt:
        runner = rt.attempt_runner(
            tasks, attempts_dir=attempts_dir, row_options=row_options(run, t.max_length)
        )
        finished = [0]

        def on_pair(p: PairResult) -> None:
            append_jsonl(out / PAIRS_LOG, _pair_record(p, attempts_dir))
            finished[0] += 1
            kept = p.kept
            print(
                f"pair {finished[0]}/{len(todo)} {p.group.task_id} [{p.group.harness}]: "
                f"{'kept ' + kept.attempt_id if kept else 'no correct attempt'} after {len(p.attempts)} attempt(s) "
                f"| elapsed {time.monotonic() - started:.0f}s",
                flush=True,
            )

        try:
            await collect_pairs(
                todo,
                runner,
                max_inflight=s.max_inflight,
                on_attempt=lambda a: append_jsonl(out / "attempts.jsonl", _attempt_record(a)),
                on_pair=on_pair,
                max_consecutive_ungraded=s.max_consecutive_empty_groups * s.max_inflight,
            )
        except CollectionAborted as err:
            write_teacher_manifest(out, store_dir, run.model.path)
            raise RunAborted(str(err)) from None
    summary = write_teacher_manifest(out, store_dir, run.model.path)
    summary["seconds"] = round(time.monotonic() - started, 1)
    summary["output_dir"] = str(out)
    write_summary(out, "fineenvs teacher collection summary", summary)
    return summary["kept_rollouts"] / summary["pairs_tried"] if summary["pairs_tried"] else 0.0
