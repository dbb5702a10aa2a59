"""``job=sft``: supervised fine-tuning on a teacher collection's kept rollouts.

SFT reads ``trainer.teacher_dir`` (the output directory of ``job=collect_teacher``,
``fineenvs.jobs.teacher``), keeps the sessions whose harness is in ``run.harness``
(``sft_opencode``: OpenCode only; ``sft_multi``: all four), builds one example per assistant turn
re-rendered with the student's chat template (``fineenvs.train.sft_trainer``), writes the dataset and its
per-harness counts, and trains with TRL's ``SFTTrainer``; the final checkpoint lands in
``<output_dir>/checkpoints/step-<N>``.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

from fineenvs.config import EngineKind, ModelSource, RunConfig
from fineenvs.jobs.builders import resolve_model_dir
from fineenvs.jobs.errors import RunAborted
from fineenvs.jsonl import JsonObject
from fineenvs.metrics import write_summary
from fineenvs.plan import TEACHER_MANIFEST, teacher_manifest_problem
from fineenvs.train.sft_config import SFTSettings

if TYPE_CHECKING:
    from fineenvs.train.sft_trainer import DatasetStats, SFTExample, SFTResult, TeacherSession


def load_teacher_sessions(teacher_dir: Path) -> tuple[list[TeacherSession], JsonObject]:
    """The kept sessions of a collection (``TeacherSession`` with their recorded calls), and its manifest."""
    path = teacher_dir / TEACHER_MANIFEST
    problem = teacher_manifest_problem(path)
    if problem:
        raise RunAborted(problem)
    from fineenvs.proxy.store import CallStore
    from fineenvs.train.sft_trainer import TeacherSession

    manifest = json.loads(path.read_text(encoding="utf-8"))
    store_dir = Path(manifest["store_dir"])
    if not store_dir.is_dir() and (teacher_dir / "records").is_dir():
        store_dir = teacher_dir / "records"  # the collection directory was moved with its records
    store = CallStore(store_dir, fsync=False)
    sessions = [
        TeacherSession(
            task_id=e["task"],
            harness=e["harness"],
            session_id=e["session_id"],
            calls=store.read_session(e["session_id"])["calls"],
        )
        for e in manifest["sessions"]
    ]
    return sessions, manifest


def select_rollouts(sessions: list[TeacherSession], t: SFTSettings) -> list[TeacherSession]:
    """The sessions trained on: ``t.rollout_slices`` of each harness's, then ``t.max_rollouts_per_harness``.

    Both count in task-id order per harness, so a slice names the same rollouts however the
    collection's manifest is ordered."""
    if not t.rollout_slices and t.max_rollouts_per_harness is None:
        return sessions
    by_harness: dict[str, list[TeacherSession]] = {}
    for s in sorted(sessions, key=lambda s: (s.harness, s.task_id)):
        by_harness.setdefault(s.harness, []).append(s)
    for harness in t.rollout_slices:
        by_harness.setdefault(harness, [])
    problems = t.collection_problems({h: len(r) for h, r in by_harness.items()})
    if problems:
        raise RunAborted("\n".join(problems))
    kept: list[TeacherSession] = []
    for harness, rollouts in by_harness.items():
        stop = t.slice_stop(harness, len(rollouts))
        if stop is not None:
            rollouts = rollouts[t.rollout_slices[harness][0] : stop]
        if t.max_rollouts_per_harness is not None:
            rollouts = rollouts[: t.max_rollouts_per_harness]
        kept.extend(rollouts)
    return kept


def student_chat_template(run: RunConfig) -> str | None:
    """The template the student is served with, when it is not the tokenizer's own.

    vLLM serves the published families with a patched non-thinking template
    (``fineenvs.engine.vllm``); the SFT prompts must be the ones the student will see there. Tiny
    models and the embedded engine use the tokenizer's template.
    """
    if run.model.source is ModelSource.tiny or run.engine.kind is not EngineKind.vllm:
        return None
    from fineenvs.engine.vllm import PROFILES, patch_template, serving_profile_of, trl_chat_template

    family = serving_profile_of(run.model.path)
    source = PROFILES[family].trl_template
    return None if source is None else patch_template(family, trl_chat_template(source))


def _eos_ids(model_dir: Path) -> list[int]:
    from transformers import GenerationConfig

    try:
        value = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value] if isinstance(value, list) else []


def run_sft(run: RunConfig) -> float | None:
    """Re-render the kept teacher rollouts for the student, write the dataset, fine-tune, summarise."""
    t = run.trainer
    assert isinstance(t, SFTSettings) and t.teacher_dir, "validate() requires trainer=sft and a teacher_dir"
    out = Path(str(run.output_dir))
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    sessions, manifest = load_teacher_sessions(Path(t.teacher_dir))
    sessions = select_rollouts(sessions, t)
    _check_harnesses_kept(run, t, sessions)
    model_dir = resolve_model_dir(run)
    examples, stats = _write_dataset(run, t, sessions, manifest, model_dir, out / "sft_dataset")
    result, losses = _fine_tune(run, t, model_dir, examples, out)
    summary = {
        "examples": len(examples),
        "teacher_rollouts": sum(stats.sessions.values()),
        "examples_per_harness": stats.examples,
        "supervised_tokens": sum(stats.supervised_tokens.values()),
        "skipped_turns": stats.skipped,
        "steps": result.global_step,
        "train_loss": result.train_loss,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "mean_loss": statistics.fmean(losses) if losses else None,
        "checkpoint": str(result.checkpoint),
        "seconds": round(time.monotonic() - started, 1),
        "output_dir": str(out),
    }
    write_summary(out, "fineenvs SFT summary", summary)
    return None


def _check_harnesses_kept(run: RunConfig, t: SFTSettings, sessions: list[TeacherSession]) -> None:
    harnesses = list(run.harness)
    available = sorted({s.harness for s in sessions})
    if not set(harnesses) & set(available):
        raise RunAborted(
            f"the teacher collection in {t.teacher_dir} kept sessions for {available or 'no harness'}, none of "
            f"the configured harnesses {harnesses}. Fix: harness=<one of those>, or collect with these harnesses."
        )


def _write_dataset(
    run: RunConfig,
    t: SFTSettings,
    sessions: list[TeacherSession],
    manifest: JsonObject,
    model_dir: Path,
    data_dir: Path,
) -> tuple[list[SFTExample], DatasetStats]:
    """The student's examples: each kept rollout re-rendered in the student's chat template (turns
    merged where they chain), written with what they came from."""
    from transformers import AutoTokenizer

    from fineenvs.train.sft_trainer import StudentRenderer, build_sft_examples, merge_turns, write_examples

    harnesses = list(run.harness)
    renderer = StudentRenderer(
        AutoTokenizer.from_pretrained(model_dir),
        chat_template=student_chat_template(run),
        template_kwargs=dict(run.model.chat_template_kwargs),
        eos_token_ids=_eos_ids(model_dir),
    )
    examples, stats = build_sft_examples(
        sessions,
        renderer,
        harnesses=harnesses,
        max_length=t.max_length,
        drop_auxiliary=run.rows.drop_auxiliary,
    )
    turns = len(examples)
    if t.merge_turns:
        examples = merge_turns(examples)
    write_examples(data_dir / "examples.jsonl", examples)
    dataset_info = {
        "teacher_dir": str(t.teacher_dir),
        "teacher_model": manifest.get("teacher_model"),
        "student_model": run.model.path,
        "harnesses": harnesses,
        "rerendered": True,
        "turns": turns,
        "merged_turns": t.merge_turns,
        **stats.to_json(),
    }
    (data_dir / "dataset.json").write_text(json.dumps(dataset_info, indent=2))
    print(
        f"SFT dataset: {len(examples)} examples ({turns} assistant turns) from {sum(stats.sessions.values())} teacher rollouts "
        f"(per harness: {stats.examples}); skipped turns: {stats.skipped or 'none'}",
        flush=True,
    )
    return examples, stats


def _fine_tune(
    run: RunConfig, t: SFTSettings, model_dir: Path, examples: list[SFTExample], out: Path
) -> tuple[SFTResult, list[float]]:
    """TRL's SFT on the examples, logging every step; returns its result and the logged losses."""
    from fineenvs.metrics import MetricLogger
    from fineenvs.train.sft_trainer import train_sft

    losses: list[float] = []
    with MetricLogger(
        run.logger, out, run_name=run.logger.name or run.experiment or "sft", config=run
    ) as logger:

        def on_log(metrics: dict[str, float], step: int) -> None:
            if "train/loss" in metrics:
                losses.append(metrics["train/loss"])
            logger.log(metrics, step=step)

        result = train_sft(model_dir, examples, t, out, on_log=on_log)
    return result, losses
