"""``recipe=mini_repro``: the learning mini-reproduction on a CPU, stage by stage.

    python -m fineenvs.run +experiment=mini_repro [output_dir=...] [recipe.rl_steps=...]

Each stage is a normal run of ``python -m fineenvs.run +experiment=mini_repro job=<job> ...`` in
``<output_dir>/<stage>`` (log: ``<stage>.log``), so every piece is the real one: the scheduler,
the capture proxy, the real agent CLIs, trajectory rows, the reward, TRL's SFT and the GRPO
trainer, checkpoints and the evaluation matrix. Nothing is scripted around them:

``teacher``  the scripted expert (``engine.policy=expert``) through the real harnesses on the
             training split: every task in ``base_harness``, ``sft_mix_tasks + base_mix_tasks`` in
             the others;
``base``     SFT of the random tiny student on the teacher's ``base_harness`` rollouts (plus
             ``base_mix_tasks`` of each other harness with ``base_sees_mix``, after their first
             ``sft_mix_tasks``, which are held out for the SFT baseline);
``rl_one``   GRPO from the base in ``rl_one_harness`` alone (default: ``base_harness``);
``rl_mix``   GRPO from the base across ``harnesses`` (one harness per group, shuffled);
``rl_mix_nobonus``  ``rl_mix`` with ``reward=correctness``: the tool bonus's control (same base,
             seed, steps and everything else);
``sft_mix``  SFT from the base on the teacher's rollouts of the first ``sft_mix_tasks`` training
             tasks of every harness (held out of the base outside ``base_harness``);
``eval``     every checkpoint (base, rl_one, rl_mix, rl_mix_nobonus, sft_mix) × harness of the mix
             on held-out eval tasks;
``eval_unseen``  the same checkpoints and tasks in ``unseen_harnesses``, which no stage trained in;
``report``   ``python -m fineenvs.report`` over the stages, and ``mini_repro.md``: the matrix, the
             paired tests, tool calls on co-solved cells, the issue's targets (``stats.py``).

Every stage gets the recipe's ``seed`` (the SFT stages' data order, the engine's sampling; the
student's initial weights are ``model.seed``'s, RL's task and harness order ``scheduler.seed``'s).
A stage whose ``STAGE_DONE`` exists is skipped, so a rerun with the same ``output_dir`` resumes;
``STAGE_DONE`` records the stage's commands and seed, and a run that would run it otherwise is
refused rather than handed another configuration's results. In a Hydra multirun
(``+sweep=mini_repro``: one recipe per seed) each job also pools the sweep's finished runs into
``<sweep dir>/mini_repro.md``.
"""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from fineenvs.config import RunConfig
from fineenvs.jobs.errors import StageFailed
from fineenvs.jsonl import read_jsonl
from fineenvs.results import EvalAttempt, deciding_attempts, paired, read_attempts, sign_test_p, wilson
from fineenvs_recipes.mini_repro import stats
from fineenvs_recipes.mini_repro.settings import RL_BATCH as _RL_BATCH
from fineenvs_recipes.mini_repro.settings import STAGES, TEACHER_POLICIES, MiniReproSettings

CHECKPOINT_STAGES = ("base", "rl_one", "rl_mix", "rl_mix_nobonus", "sft_mix")
DONE = "STAGE_DONE"


def _list(values: list[str]) -> str:
    return "[" + ",".join(values) + "]"


def _rl_overrides(
    m: MiniReproSettings, harnesses: list[str], base: Path, learning_rate: float | None = None
) -> list[str]:
    return [
        "job=rl",
        "trainer=grpo",
        "model.source=local",
        f"model.path={base}",
        f"harness={_list(harnesses)}",
        f"trainer.max_steps={m.rl_steps}",
        f"trainer.learning_rate={m.rl_learning_rate if learning_rate is None else learning_rate}",
        f"trainer.save_steps={m.eval_every}",
        f"trainer.eval_steps={m.eval_every}",
        # The eval stage evaluates the final checkpoint on the whole matrix: the hook's own
        # evaluation of it, on a subset, would repeat that (~7 min of an rl_mix stage).
        "trainer.eval_at_end=false",
        f"eval.subset_during_training={m.eval_tasks_during_training}",
        f"scheduler.group_size={m.group_size}",
        f"scheduler.max_inflight={max(4, m.group_size)}",  # a whole group runs at once
        # Not the published rotation: the train split cycles its three templates, so rotating three
        # harnesses gave Pi only rows questions, Mini-SWE-Agent only sum, OpenCode only max.
        "scheduler.harness_selection=shuffled",
        "trainer.dynamic_sampling=true",  # steps only from groups with signal (see GRPOSettings)
        f"trainer.dynamic_sampling_max_groups={'null' if m.rl_max_groups_per_step is None else m.rl_max_groups_per_step}",
        f"trainer.per_device_batch_size={_RL_BATCH}",
        f"trainer.gradient_accumulation_steps={m.rl_rows_per_step // _RL_BATCH}",
        "trainer.token_budget=32768",
        "trainer.dtype=float32",
        "trainer.gradient_checkpointing=false",
    ]


def _slices(slices: dict[str, list[int]]) -> list[str]:
    # One "+" override per harness: Hydra merges a whole-dict value, which adds no key in struct mode.
    return [
        f"+trainer.rollout_slices.{h}=[{','.join(str(b) for b in bounds)}]" for h, bounds in slices.items()
    ]


def _sft_overrides(
    m: MiniReproSettings,
    harnesses: list[str],
    teacher: Path,
    epochs: float,
    learning_rate: float,
    slices: dict[str, list[int]],
) -> list[str]:
    return [
        "job=sft",
        "trainer=sft",
        f"harness={_list(harnesses)}",
        f"trainer.teacher_dir={teacher}",
        *_slices(slices),
        f"trainer.num_train_epochs={epochs}",
        f"trainer.learning_rate={learning_rate}",
        # Decayed, not constant: at a constant 3e-3 the last few batches decided which command the
        # student wrote for every question (it flipped from tail to cut to awk between epochs).
        "trainer.lr_scheduler_type=cosine",
        "trainer.warmup_steps=10",
        "trainer.per_device_batch_size=1",
        f"trainer.gradient_accumulation_steps={m.sft_gradient_accumulation}",
        "trainer.max_length=32768",
        "trainer.merge_turns=true",  # one example per rollout where its turns chain (each context once)
        "trainer.save_steps=100000",
        "trainer.dtype=float32",
        "trainer.gradient_checkpointing=false",
    ]


def engine_overrides(run: RunConfig) -> list[str]:
    """What the RL and evaluation stages add for the recipe's engine: nothing for the embedded
    engine (the stages' default); with ``engine=vllm``, vLLM (its CPU build here) with its prefix
    cache on, as agents resend their growing histories. The teacher stays on the embedded engine,
    whose scripted expert it is; the SFT stages start no engine."""
    from fineenvs.config import EngineKind

    if run.engine.kind is not EngineKind.vllm:
        return []
    return ["engine=vllm", "engine.enable_prefix_caching=true"]


def stage_commands(
    m: MiniReproSettings, out: Path, checkpoints: dict[str, Path], engine: list[str] | None = None
) -> dict[str, list[list[str]]]:
    """The ``fineenvs.run`` override lists of each stage (a stage may be several runs); ``engine``
    is ``engine_overrides``' list for the stages that serve the student."""
    engine = engine or []
    others = [h for h in m.harnesses if h != m.base_harness]
    teacher = out / "teacher"
    # The first sft_mix_tasks training tasks of every other harness (and of the base harness with
    # hold_out_base_harness) are the SFT baseline's, never the base's.
    held = m.sft_mix_tasks if "sft_mix" in m.stages else 0
    base_mix = m.base_mix_tasks if m.base_sees_mix else 0
    base_slices = {m.base_harness: [held]} if held and m.hold_out_base_harness else {}
    if base_mix:
        base_slices.update({h: [held, held + base_mix] for h in others})
    collect = [
        "job=collect_teacher",
        "trainer=sft",
        f"engine.policy={TEACHER_POLICIES[m.teacher_habit]}",
        "trainer.teacher_attempts_per_task=1",
    ]
    limit = "null" if m.teacher_tasks is None else str(m.teacher_tasks)
    commands: dict[str, list[list[str]]] = {
        "teacher": [[*collect, f"harness=[{m.base_harness}]", f"tasks.limit={limit}"]],
        "base": [
            _sft_overrides(
                m,
                list(m.harnesses) if base_mix else [m.base_harness],
                teacher,
                m.base_epochs,
                m.sft_learning_rate,
                base_slices,
            )
        ],
    }
    if others and held + base_mix:
        commands["teacher"].append([*collect, f"harness={_list(others)}", f"tasks.limit={held + base_mix}"])
    base = checkpoints.get("base")
    if base is not None:
        one = m.rl_one_harness or m.base_harness
        commands["rl_one"] = [[*_rl_overrides(m, [one], base, m.rl_one_learning_rate), *engine]]
        commands["rl_mix"] = [[*_rl_overrides(m, list(m.harnesses), base), *engine]]
        # The bonus's control: rl_mix to the letter but for the reward (correctness alone), so the
        # report can tell the bonus's tool-call cut from what any RL (or SFT) does to call counts.
        commands["rl_mix_nobonus"] = [
            [*_rl_overrides(m, list(m.harnesses), base), "reward=correctness", *engine]
        ]
        commands["sft_mix"] = [
            [
                *_sft_overrides(
                    m,
                    list(m.harnesses),
                    teacher,
                    m.sft_mix_epochs,
                    m.sft_mix_learning_rate,
                    {h: [0, m.sft_mix_tasks] for h in m.harnesses},
                ),
                "model.source=local",
                f"model.path={base}",
            ]
        ]
    ready = [checkpoints[s] for s in CHECKPOINT_STAGES if s in checkpoints]
    if ready:

        def evaluate(harnesses: list[str]) -> list[str]:
            return [
                "job=eval",
                "trainer=grpo",
                f"harness={_list(harnesses)}",
                f"eval.checkpoints={_list([str(p) for p in ready])}",
                "eval.split=eval",
                f"eval.limit={m.eval_tasks if m.eval_tasks is not None else 'null'}",
                *engine,
                "engine.weight_sync=none",
            ]

        commands["eval"] = [evaluate(list(m.harnesses))]
        # A stage of its own, not more harnesses in eval's: a finished eval stays reusable, and a
        # recipe that lists its stages (the learning test) evaluates exactly what it did before.
        if m.unseen_harnesses:
            commands["eval_unseen"] = [evaluate(list(m.unseen_harnesses))]
    return commands


def stage_extra(run: RunConfig, m: MiniReproSettings) -> list[str]:
    """Overrides every stage gets after its own: this run's seed (the stages are runs of their own,
    which would otherwise start from the default seed: ``seed=1`` on the recipe's command line would
    change nothing), then ``recipe.overrides``."""
    return [f"seed={run.seed}", *m.overrides]


def _stage_checkpoint(stage_dir: Path) -> Path | None:
    summary = stage_dir / "summary.json"
    if summary.is_file():
        ckpt = json.loads(summary.read_text()).get("checkpoint")
        if ckpt and Path(ckpt).is_dir():
            return Path(ckpt)
    from fineenvs.jobs.rl import latest_checkpoint

    return latest_checkpoint(stage_dir / "checkpoints")


def _run_stage(name: str, runs: list[list[str]], out: Path, extra: list[str]) -> float:
    stage_dir = out / name
    stage_dir.mkdir(parents=True, exist_ok=True)
    log = out / f"{name}.log"
    started = time.monotonic()
    with log.open("a", encoding="utf-8") as f:
        for overrides in runs:
            cmd = [
                sys.executable,
                "-m",
                "fineenvs.run",
                "+experiment=mini_repro",
                *overrides,
                *extra,
                f"output_dir={stage_dir}",
            ]
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            child = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
            try:
                returncode = child.wait()
            except KeyboardInterrupt:  # this run is stopping: the stage stops as it would alone
                child.send_signal(signal.SIGTERM)
                try:
                    child.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    child.kill()
                raise
            if returncode != 0:
                tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-30:]
                raise StageFailed(
                    f"stage {name} failed (exit {returncode}); its log is {log}. Last lines:\n"
                    + "\n".join(tail)
                    + "\nFix the cause and rerun the same command: finished stages are skipped."
                )
    seconds = time.monotonic() - started
    done = {"seconds": round(seconds, 1), "runs": runs, "extra": extra}
    (stage_dir / DONE).write_text(json.dumps(done) + "\n")
    return seconds


def _check_reuse(name: str, stage_dir: Path, runs: list[list[str]] | None, extra: list[str]) -> None:
    """A finished stage is reused only by a run that would run it the same way (``STAGE_DONE``
    records its commands and the seed; files from before that recorded nothing and are reused)."""
    done = json.loads((stage_dir / DONE).read_text())
    for key, wanted in (("extra", extra), ("runs", runs)):
        if key in done and wanted is not None and done[key] != wanted:
            # An evaluation asked for more checkpoints (a run from before rl_mix_nobonus) can be
            # extended in place: the eval job grades only the cells its attempts.jsonl lacks.
            extend = (
                f" For an evaluation that only lacks checkpoints (a run finished before a new stage "
                f"existed), delete {stage_dir / DONE} and rerun: the graded cells are kept and only the "
                "new checkpoints' are run."
                if name in ("eval", "eval_unseen") and key == "runs"
                else ""
            )
            raise StageFailed(
                f"stage {name} in {stage_dir} was finished with other settings: {done[key]}, where this run "
                f"asks for {wanted}. Reusing it would mix two configurations (another seed, say) in one "
                "result. Fix: another output_dir for these settings (a sweep gives each job its own "
                "folder), or rerun with the settings that finished it to resume." + extend
            )


class MiniRepro:
    """The recipe: ``setup`` checks what a rerun may reuse, ``train`` runs the stages in order (each
    a run of its own, skipped when done), ``cleanup`` has nothing to release (every stage's run
    stops its own processes)."""

    def __init__(self, run: RunConfig, settings: MiniReproSettings) -> None:
        self.run = run
        self.settings = settings
        self.out = Path(str(run.output_dir))
        self.checkpoints: dict[str, Path] = {}

    def setup(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)

    def train(self) -> float | None:
        started = time.monotonic()
        extra = stage_extra(self.run, self.settings)
        engine = engine_overrides(self.run)
        for stage in self.settings.stages:
            self._stage(stage, extra, engine)
        total = time.monotonic() - started
        print(f"mini_repro: all stages done in {total:.0f}s; output in {self.out}", flush=True)
        results = self.out / "eval" / "eval" / "results.json"
        if results.is_file():
            overall = json.loads(results.read_text())["overall"]
            return float(list(overall.values())[-1]) if overall else None
        return None

    def cleanup(self) -> None:
        return None

    def _stage(self, stage: str, extra: list[str], engine: list[str]) -> None:
        out = self.out
        stage_dir = out / stage
        runs = stage_commands(self.settings, out, self.checkpoints, engine).get(stage)
        if stage != "report" and (stage_dir / DONE).is_file():
            _check_reuse(stage, stage_dir, runs, extra)
            print(f"mini_repro: {stage} already done ({stage_dir})", flush=True)
        elif stage == "report":
            report_dir = write_report(out, self.settings)
            print(f"mini_repro: report in {report_dir}", flush=True)
        elif stage == "eval_unseen" and not self.settings.unseen_harnesses:
            print("mini_repro: eval_unseen skipped (recipe.unseen_harnesses is empty)", flush=True)
        else:
            if runs is None:
                raise StageFailed(
                    f"stage {stage} needs the base checkpoint (stage base) first: add base to recipe.stages"
                )
            print(f"mini_repro: {stage} ... (log: {out / (stage + '.log')})", flush=True)
            seconds = _run_stage(stage, runs, out, extra)
            print(f"mini_repro: {stage} done in {seconds:.0f}s", flush=True)
        if stage in CHECKPOINT_STAGES:
            ckpt = _stage_checkpoint(stage_dir)
            if ckpt is None:
                raise StageFailed(f"stage {stage} finished without a checkpoint under {stage_dir}")
            self.checkpoints[stage] = ckpt


# --------------------------------------------------------------------------- the table


def _stage_label(out: Path, key: str) -> str:
    # With the separator: rl_mix's folder is a prefix of rl_mix_nobonus's.
    for stage in CHECKPOINT_STAGES:
        if f"/{stage}/checkpoints/" in key or (str(out / stage) + "/") in key:
            return stage
    return key


@dataclass
class EvalData:
    """A run's evaluation, the mix (stage ``eval``) and the unseen harnesses (``eval_unseen``) together:
    cells from each stage's ``results.json``, deciding attempts by stage name for the paired
    statistics."""

    mix: list[str]
    unseen: list[str]
    tasks: int
    keys: list[str]
    """Checkpoint paths, in the evaluation's order (the base first)."""
    cells: dict[str, dict[str, dict[str, Any]]]
    task_ids: list[str]
    finals: dict[str, dict[tuple[str, str], EvalAttempt]]
    attempts: list[dict[str, Any]]


def eval_data(out: Path) -> EvalData | None:
    """The run's evaluation, or None before its ``eval`` stage wrote ``results.json``."""
    path = out / "eval" / "eval" / "results.json"
    if not path.is_file():
        return None
    r = json.loads(path.read_text())
    mix = list(r["harnesses"])
    cells = {k: dict(v) for k, v in r["cells"].items()}
    raw = read_jsonl(out / "eval" / "eval" / "attempts.jsonl")
    attempts = read_attempts(out / "eval" / "eval" / "attempts.jsonl")
    unseen: list[str] = []
    unseen_path = out / "eval_unseen" / "eval" / "results.json"
    if unseen_path.is_file():
        u = json.loads(unseen_path.read_text())
        unseen = [h for h in u["harnesses"] if h not in mix]
        for key, by_h in u["cells"].items():
            cells.setdefault(key, {}).update({h: c for h, c in by_h.items() if h in unseen})
        more = out / "eval_unseen" / "eval" / "attempts.jsonl"
        raw += [a for a in read_jsonl(more) if a.get("harness") in unseen]
        attempts += [a for a in read_attempts(more) if a.harness in unseen]
    finals = deciding_attempts(attempts)
    return EvalData(
        mix=mix,
        unseen=unseen,
        tasks=r["tasks"],
        keys=list(r["checkpoints"]),
        cells=cells,
        task_ids=sorted({a.task_id for a in attempts if a.harness in mix}),
        finals={_stage_label(out, k): finals.get(k, {}) for k in r["checkpoints"]},
        attempts=raw,
    )


def _pass_cell(solved: int, n: int) -> str:
    lo, hi = wilson(solved, n)
    return f"{solved / n:.2f} [{lo:.2f}, {hi:.2f}]" if n else "-"


def _matrix(out: Path, ev: EvalData) -> list[str]:
    n, mix, unseen = ev.tasks, ev.mix, ev.unseen
    lines = [
        f"pass@1 on {n} held-out eval tasks per harness (95% Wilson interval over tasks)"
        + (
            f"; all: the mix; {', '.join(unseen)} unseen (no stage trained in it, the teacher never collected in it)"
            if unseen
            else ""
        )
        + ":",
        "",
        "| checkpoint | " + " | ".join([*mix, "all", *(f"{h} (unseen)" for h in unseen)]) + " |",
        "|---" * (len(mix) + len(unseen) + 2) + "|",
    ]
    for key in ev.keys:
        label = _stage_label(out, key)
        row = [_pass_cell(_solved(ev, label, h), n) for h in mix]
        row.append(_pass_cell(sum(_solved(ev, label, h) for h in mix), n * len(mix)))
        row += [_pass_cell(_solved(ev, label, h), n) if h in ev.cells[key] else "-" for h in unseen]
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    return lines


def _solved(ev: EvalData, stage: str, harness: str) -> int:
    """Cells of ``harness`` that ``stage``'s checkpoint solved, from the deciding attempts as the
    paired tests count them (not the eval job's ``results.json``): one rule decides every figure of
    the report, also when a report is rebuilt under a newer rule than the evaluation ran with."""
    return stats.solved_count(ev.finals.get(stage, {}), ev.task_ids, harness)


# Tool calls on co-solved cells: each checkpoint against the base, and the bonus against its control.
CALL_PAIRS = (
    ("rl_one", "base"), ("rl_mix", "base"), ("rl_mix_nobonus", "base"), ("sft_mix", "base"),
    ("rl_mix", "rl_mix_nobonus"),
)  # fmt: skip


def _calls_table(ev: EvalData) -> list[str]:
    columns = [*ev.mix, "all", *(f"{h} (unseen)" for h in ev.unseen)]
    lines = [
        "",
        "Tool calls on co-solved cells (cells both checkpoints solved): the second's mean → the first's, "
        "the change in the mean, and its 95 % paired bootstrap interval over the co-solved cells "
        f"({stats.BOOTSTRAP_RESAMPLES} resamples, seed {stats.BOOTSTRAP_SEED}; "
        "fineenvs_recipes/mini_repro/stats.py):",
        "",
        "| comparison | " + " | ".join(columns) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    headline = None
    for a, b in CALL_PAIRS:
        if a not in ev.finals or b not in ev.finals:
            continue
        fa, fb = ev.finals[a], ev.finals[b]
        row = []
        for col in [*ev.mix, None, *ev.unseen]:
            hs = [col] if col else ev.mix
            r = stats.call_ratio(stats.co_solved_calls(fa, fb, hs))
            row.append(stats.format_change(r))
            if col is None and (a, b) == ("rl_mix", "rl_mix_nobonus"):
                headline = r
        lines.append(f"| {a} vs {b} | " + " | ".join(row) + " |")
    if headline is not None and headline.change is not None:
        word = "fewer" if headline.change < 0 else "more"
        lines += [
            "",
            f"**The tool bonus against its control:** rl_mix (bonus) uses {abs(headline.change) * 100:.0f} % "
            f"{word} tool calls than rl_mix_nobonus on {headline.cells} co-solved cells of the mix "
            f"[95 % CI {(headline.low or 0) * 100:+.0f} %, {(headline.high or 0) * 100:+.0f} %]; fewer in "
            f"{headline.fewer} cells, more in {headline.more}.",
        ]
    return lines


def _rl_one_harness(out: Path, given: str | None, mix: list[str]) -> str:
    """The harness rl_one trained in: given, else from rl_one's ``STAGE_DONE``, else the first."""
    if given:
        return given
    done = out / "rl_one" / DONE
    if done.is_file():
        runs: list[list[str]] = json.loads(done.read_text()).get("runs", [[]])
        for o in runs[0]:
            if o.startswith("harness=["):
                return str(o[len("harness=[") : -1].split(",")[0])
    return mix[0]


def summary_table(out: Path, rl_one_harness: str | None = None) -> str:
    """``mini_repro.md``: pass@1 (95% Wilson interval over tasks) per checkpoint × harness (the
    unseen harnesses apart), the paired tests, tool calls on co-solved cells with intervals, the
    issue's targets (1)-(6), rows per attempt, ``train/ratio``, signal accounting, wall time."""
    lines: list[str] = []
    ev = eval_data(out)
    if ev is not None:
        lines += _matrix(out, ev)
        lines += _paired_table(ev)
        lines += _calls_table(ev)
        found = stats.targets(
            ev.finals, ev.task_ids, ev.mix, ev.unseen, _rl_one_harness(out, rl_one_harness, ev.mix)
        )
        lines += ["", "Targets for one run (issue 36; each test fixed in stats.py, never tuned):", ""]
        lines += stats.targets_table(found)
        lines += [
            "",
            "Prompt tokens per model call and seconds per attempt, per harness (eval, base; medians over attempts):",
            "",
        ]
        first = ev.keys[0] if ev.keys else None
        for h in [*ev.mix, *ev.unseen]:
            mine = [a for a in ev.attempts if a.get("harness") == h and a.get("checkpoint") == first]
            per_call = [a["prompt_tokens"] / a["model_calls"] for a in mine if a.get("model_calls")]
            seconds = [float(a.get("duration_seconds", 0.0)) for a in mine]
            if per_call:
                lines.append(
                    f"- {h}: {statistics.median(per_call):.0f} prompt tokens per call, "
                    f"{statistics.median(seconds):.0f} s per attempt"
                )
    for stage in ("rl_one", "rl_mix", "rl_mix_nobonus"):
        metrics = read_jsonl(out / stage / "metrics.jsonl")
        attempts = read_jsonl(out / stage / "attempts.jsonl")
        if not metrics and not attempts:
            continue
        lines += ["", f"{stage}:", ""]
        steps = [m for m in metrics if "train/ratio" in m]
        if steps:
            ratios = [m["train/ratio"] for m in steps]
            rewards = [m.get("reward/mean") for m in steps if m.get("reward/mean") is not None]
            lines.append(
                f"- {len(steps)} steps; train/ratio {min(ratios):.5f}–{max(ratios):.5f}; reward/mean per step: "
                + ", ".join(f"{x:.2f}" for x in rewards)
            )
        rows: dict[str, list[float]] = defaultdict(list)
        for a in attempts:
            rows[a["harness"]].append(float(a.get("metrics", {}).get("rows", 0.0)))
        if rows:
            lines.append(
                "- rows per attempt: "
                + ", ".join(f"{h} {statistics.fmean(v):.2f}" for h, v in sorted(rows.items()))
            )
        summary = out / stage / "summary.json"
        if summary.is_file():
            s = json.loads(summary.read_text())
            lines.append(
                f"- groups by signal: {s.get('groups_by_signal')}; groups without signal: "
                f"{s.get('groups_without_signal')} of {s.get('groups')}"
            )
        if attempts:
            lines.append("- tool calls: " + stats.format_bonus_accounting(stats.bonus_accounting(attempts)))
    times = []
    for stage in STAGES:
        done = out / stage / DONE
        if done.is_file():
            times.append(f"{stage} {json.loads(done.read_text())['seconds']:.0f}s")
    if times:
        total = sum(
            json.loads((out / s / DONE).read_text())["seconds"] for s in STAGES if (out / s / DONE).is_file()
        )
        lines += ["", "Wall time per stage: " + ", ".join(times) + f"; all {total / 60:.0f} min"]
    return "\n".join(lines) + "\n"


# The published comparisons: each later checkpoint against the base, RL against SFT on the mix,
# and RL across the mix against RL in one harness; then the bonus's control against both.
PAIRS = (
    ("rl_one", "base"), ("rl_mix", "base"), ("sft_mix", "base"),
    ("rl_one", "sft_mix"), ("rl_mix", "sft_mix"), ("rl_mix", "rl_one"),
    ("rl_mix_nobonus", "base"), ("rl_mix", "rl_mix_nobonus"),
)  # fmt: skip


def _paired_counts(ev: EvalData) -> dict[tuple[str, str], dict[str, Any]]:
    """``PAIRS`` on one evaluation's cells (``results.paired``): won / lost over the mix, and per
    harness of the mix and the unseen ones."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for a, b in PAIRS:
        if a in ev.finals and b in ev.finals:
            d = paired(ev.finals[b], ev.finals[a], ev.task_ids, ev.mix)
            for h in ev.unseen:
                d["per_harness"][h] = paired(ev.finals[b], ev.finals[a], ev.task_ids, [h])
            out[(a, b)] = d
    return out


def _paired_header(harnesses: list[str], extra: str = "", unseen: list[str] | None = None) -> list[str]:
    columns = [*harnesses, "all", *(f"{h} (unseen)" for h in unseen or [])]
    return [
        "",
        "Paired (cells the first checkpoint solved and the second did not: won / lost; one-sided exact sign test):",
        "",
        "| comparison | " + " | ".join(columns) + " |" + extra,
        "|---" * (len(columns) + 1 + bool(extra)) + "|",
    ]


def _paired_table(ev: EvalData) -> list[str]:
    lines = _paired_header(ev.mix, unseen=ev.unseen)
    for (a, b), d in _paired_counts(ev).items():
        cells = [_won_lost(d["per_harness"][h]) for h in ev.mix] + [_won_lost(d)]
        cells += [_won_lost(d["per_harness"][h]) for h in ev.unseen]
        lines.append(f"| {a} vs {b} | " + " | ".join(cells) + " |")
    return lines


def _won_lost(d: dict[str, Any]) -> str:
    return f"{d['won']} / {d['lost']}" + (f" (p = {d['p']:.2g})" if d["won"] > d["lost"] else "")


def _count(won: int, lost: int) -> dict[str, Any]:
    return {"won": won, "lost": lost, "p": sign_test_p(won, lost)}


def _run_seed(out: Path) -> str:
    """The seed a recipe run's evaluation ran at, from its ``STAGE_DONE``."""
    done = out / "eval" / DONE
    extra = json.loads(done.read_text()).get("extra", []) if done.is_file() else []
    return next((o.split("=", 1)[1] for o in extra if o.startswith("seed=")), "?")


def pooled_table(outs: list[Path]) -> str:
    """Several recipe runs of one configuration (a seed sweep) pooled: pass@1 per checkpoint ×
    harness over every run's cells, the paired comparisons summed over runs with one sign test on
    the sums, and each run's own count. Every run is evaluated on the same held-out tasks, so the
    pooled interval and test (which take tasks × runs as independent) overstate what several runs
    show when they agree because of the tasks; the per-run column is the reading with the run as
    its unit."""
    runs = [(o, json.loads((o / "eval" / "eval" / "results.json").read_text())) for o in outs]
    if not runs:
        return "No recipe run with a finished evaluation here yet.\n"
    harnesses = list(runs[0][1]["harnesses"])
    solved: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    runs_of: dict[str, int] = defaultdict(int)
    pairs: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    co: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])  # cells, base calls, calls
    bonus: list[tuple[float, float]] = []  # co-solved (rl_mix, rl_mix_nobonus) calls of every run
    found: list[list[stats.Target]] = []
    for out, r in runs:
        if list(r["harnesses"]) != harnesses:
            raise ValueError(
                f"{out} evaluated {r['harnesses']}, {runs[0][0]} {harnesses}: runs pool only over the same "
                "harnesses. Fix: pool the runs of one configuration"
            )
        ev = eval_data(out)
        assert ev is not None  # runs come with results.json
        for key in r["checkpoints"]:
            stage = _stage_label(out, key)
            runs_of[stage] += 1
            for h in harnesses:
                solved[stage][h][0] += _solved(ev, stage, h)
                solved[stage][h][1] += r["tasks"]
        for pair, d in _paired_counts(ev).items():
            pairs[pair].append(d)
        if "rl_mix" in ev.finals and "rl_mix_nobonus" in ev.finals:
            bonus += stats.co_solved_calls(ev.finals["rl_mix"], ev.finals["rl_mix_nobonus"], ev.mix)
        found.append(
            stats.targets(ev.finals, ev.task_ids, ev.mix, ev.unseen, _rl_one_harness(out, None, ev.mix))
        )
        for pair, detail in r.get("co_solved", {}).items():
            if detail.get("mean_tool_calls") is None or detail.get("mean_tool_calls_base") is None:
                continue
            n, c = detail["cells"], co[_stage_label(out, pair.split(" vs ")[0])]
            c[0] += n
            c[1] += n * detail["mean_tool_calls_base"]
            c[2] += n * detail["mean_tool_calls"]
    names = ", ".join(f"{o.name}: seed {_run_seed(o)}" for o, _ in runs)
    lines = [
        f"{len(runs)} runs pooled ({names}); pass@1 over every run's held-out cells (95% Wilson interval "
        "over tasks × runs; every run has the same tasks, so it is narrower than the runs' spread):",
        "",
        "| checkpoint | " + " | ".join(harnesses) + " | all | runs |",
        "|---" * (len(harnesses) + 3) + "|",
    ]
    for stage, by_harness in solved.items():
        row = []
        for h in [*harnesses, None]:
            k, n = (
                by_harness[h]
                if h
                else [sum(by_harness[x][0] for x in harnesses), sum(by_harness[x][1] for x in harnesses)]
            )
            lo, hi = wilson(k, n)
            row.append(f"{k / n:.2f} [{lo:.2f}, {hi:.2f}]" if n else "-")
        lines.append(f"| {stage} | " + " | ".join(row) + f" | {runs_of[stage]} |")
    lines += _paired_header(harnesses, " each run, all harnesses (* p < 0.05) |")
    for (a, b), ds in pairs.items():
        cells = [
            _won_lost(
                _count(
                    sum(d["per_harness"][h]["won"] for d in ds), sum(d["per_harness"][h]["lost"] for d in ds)
                )
            )
            for h in harnesses
        ]
        total = _count(sum(d["won"] for d in ds), sum(d["lost"] for d in ds))
        each = ", ".join(
            f"{d['won']} / {d['lost']}" + ("*" if d["won"] > d["lost"] and d["p"] < 0.05 else "") for d in ds
        )
        lines.append(f"| {a} vs {b} | " + " | ".join(cells) + f" | {_won_lost(total)} | {each} |")
    lines += ["", "Tool calls on co-solved cells (against the base, pooled):", ""]
    for stage, (n, base_calls, calls) in co.items():
        if n and base_calls:
            lines.append(
                f"- {stage} vs base: {n:.0f} cells, {base_calls / n:.2f} → {calls / n:.2f} tool calls "
                f"({(calls - base_calls) / base_calls * 100:+.0f}%)"
            )
    if bonus:
        lines.append(
            "- rl_mix vs rl_mix_nobonus (the bonus against its control; the interval resamples the "
            f"runs' co-solved cells together): {stats.format_change(stats.call_ratio(bonus))}"
        )
    lines += [
        "",
        "Targets (issue 36) in each run, and in how many runs each holds (the sweep's target: (1)-(5) "
        "in at least two of three):",
        "",
        "| target | " + " | ".join(o.name for o, _ in runs) + " | runs reached |",
        "|---" * (len(runs) + 2) + "|",
    ]
    for i, t in enumerate(found[0]):
        statuses = [f[i].status for f in found]
        reached = sum(1 for x in statuses if x == "reached")
        counted = "-" if t.number == 6 else f"{reached} of {len(runs)}"
        lines.append(f"| ({t.number}) | " + " | ".join(statuses) + f" | {counted} |")
    times = []
    for out, _ in runs:
        done = [out / stage / DONE for stage in STAGES]
        seconds = sum(json.loads(p.read_text())["seconds"] for p in done if p.is_file())
        times.append(f"{out.name} {seconds / 60:.0f} min")
    lines += ["", "Wall time per run (its stages): " + ", ".join(times)]
    return "\n".join(lines) + "\n"


def _job_overrides(job: Path) -> list[str] | None:
    """A sweep job's command-line overrides (Hydra's ``.hydra/overrides.yaml``) less its seed."""
    path = job / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return None
    listed = OmegaConf.to_container(OmegaConf.load(path))
    return sorted(
        str(o) for o in (listed if isinstance(listed, list) else []) if not str(o).startswith("seed=")
    )


def sweep_runs(sweep: Path, like: Path | None = None) -> list[Path]:
    """The recipe runs of a Hydra multirun directory whose evaluation finished, in job order; with
    ``like``, only those whose overrides differ from ``like``'s in the seed alone (a sweep over
    other settings is not pooled as if its runs were repeats)."""
    found = [
        p.parent.parent
        for p in sweep.glob(f"*/eval/{DONE}")
        if (p.parent / "eval" / "results.json").is_file()
    ]
    if like is not None:
        found = [p for p in found if _job_overrides(p) == _job_overrides(like)]
    return sorted(found, key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name))


def write_report(out: Path, m: MiniReproSettings) -> Path:
    (out / "mini_repro.md").write_text(summary_table(out), encoding="utf-8")
    subprocess.run([sys.executable, "-m", "fineenvs.report", str(out)], check=False)
    # A job of a sweep (Hydra writes multirun.yaml into the sweep directory) also pools the sweep's
    # runs so far: the seed-to-seed variation is what one run's table cannot show. A failure here
    # must not fail the hour-long run whose own report is written.
    sweep = out.parent
    if (sweep / "multirun.yaml").is_file():
        try:
            (sweep / "mini_repro.md").write_text(pooled_table(sweep_runs(sweep, like=out)), encoding="utf-8")
        except (OSError, ValueError, KeyError) as err:
            print(
                f"mini_repro: could not pool the sweep's runs into {sweep / 'mini_repro.md'}: {err}",
                flush=True,
            )
    return out / "report"
