"""The RL job: engine → probe → proxy → scheduler (real agents) → GRPO on captured rows → weights.

Start order: engine healthy, engine probed (training refuses anything below the ``tokens`` grade),
proxy listening on loopback in its own process (a crash of this one loses no recorded call),
trainer (resumed from the newest checkpoint in the output directory), then the scheduler drives
the agents. Everything stops in reverse order on exit, Ctrl-C or error.

Per finished group: groups more than ``scheduler.max_staleness`` policy versions behind are
dropped and counted; group-relative advantages come from graded attempts only (``None`` rewards
are excluded from the baseline, groups with fewer than two graded attempts give no signal); every
trainable row of an attempt is stamped with that attempt's advantage. An optimizer step runs once
``per_device_batch_size × gradient_accumulation_steps`` rows wait; weights go to the engine every
``weight_sync_interval`` steps; a checkpoint (trainer and rollout state) every ``save_steps``. The
run aborts after ``max_consecutive_empty_groups`` groups in a row without trainable rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import statistics
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from fineenvs.config import VLLM_WEIGHT_SYNCS, ModelSource, RunConfig, WeightSyncKind, engine_dtype
from fineenvs.jobs.builders import resolve_model_dir, row_options
from fineenvs.jobs.errors import RunAborted
from fineenvs.jobs.runtime import JobRuntime, Probe, check_harnesses, job_runtime
from fineenvs.jsonl import JsonObject, append_jsonl
from fineenvs.metrics import MetricLogger, metric_key, write_summary
from fineenvs.plan import effective_weight_sync
from fineenvs.rollout.schedule import HarnessMix, PlannedGroup, build_schedule, schedule_hash
from fineenvs.rollout.scheduler import GroupOutcome, RolloutScheduler, RolloutState
from fineenvs.tasks.model import Task
from fineenvs.tasks.selection import select_tasks
from fineenvs.train.grpo_config import GRPOSettings
from fineenvs.trajectory import RowOptions

if TYPE_CHECKING:
    from rich.progress import Progress

    from fineenvs.engine.handle import EngineHandle
    from fineenvs.engine.parity import ParityGate
    from fineenvs.rollout.scheduler import AttemptOutcome
    from fineenvs.train.grpo import CapturedGRPOTrainer
    from fineenvs.train.lockstep import Lockstep
    from fineenvs.train.train_rows import TrainRow

log = logging.getLogger("fineenvs.jobs.rl")


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    done = sorted(
        (p for p in ckpt_root.glob("step-*") if (p / "COMPLETE").exists()),
        key=lambda p: int(p.name.split("-")[1]),
    )
    return done[-1] if done else None


# --------------------------------------------------------------------------- the loop


@dataclass
class LoopStats:
    steps: int = 0
    groups: int = 0
    attempts: int = 0
    rows_trained: int = 0
    stale_dropped: int = 0
    no_signal: int = 0  # groups whose rows all train with advantage 0 (any reason below)
    dropped_no_signal: int = 0  # of those, left out of the batch (trainer.dynamic_sampling)
    short_steps: int = 0  # steps trained on fewer rows: trainer.dynamic_sampling_max_groups reached
    signal_kinds: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    empty_groups: int = 0
    consecutive_empty: int = 0
    weight_pushes: int = 0
    rewards: list[float] = field(default_factory=list)
    first_ratio: float | None = None
    last_ratio: float | None = None
    parity: list[float] = field(default_factory=list)  # the gate's mean |engine - trainer|, each check
    exit_reasons: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    infra_retried: int = 0  # attempts lost to the infrastructure and run again (scheduler.infra_retries)


def group_metrics(groups: list[GroupOutcome]) -> dict[str, float]:
    """Per-harness reward/pass/tool/row/duration metrics for the groups of one step."""
    by: dict[str, list[AttemptOutcome]] = defaultdict(list)
    kinds: dict[str, Counter[str]] = defaultdict(Counter)
    for g in groups:
        by[g.planned.harness].extend(g.attempts)
        kinds[g.planned.harness][g.signal()] += 1
    out: dict[str, float] = {}
    for h, counts in kinds.items():
        # Groups of this step without learning signal (every row trains with advantage 0).
        out[metric_key("rollout", "groups", h)] = float(sum(counts.values()))
        out[metric_key("rollout", "groups_no_signal", h)] = float(sum(counts.values()) - counts["signal"])
        out[metric_key("rollout", "groups_all_correct", h)] = float(counts["all_correct"])
        out[metric_key("rollout", "groups_all_zero", h)] = float(counts["all_zero"])
    for h, attempts in by.items():
        graded = [a.reward for a in attempts if a.reward is not None]
        if graded:
            out[metric_key("rollout", "reward_mean", h)] = statistics.fmean(graded)
            out[metric_key("rollout", "reward_std", h)] = statistics.pstdev(graded)
            out[metric_key("rollout", "pass_rate", h)] = sum(1 for r in graded if r > 0) / len(graded)
        tools = [a.tool_calls for a in attempts if a.tool_calls is not None]
        if tools:
            out[metric_key("rollout", "tool_calls_mean", h)] = statistics.fmean(tools)
        out[metric_key("rollout", "rows_per_attempt", h)] = statistics.fmean(len(a.rows) for a in attempts)
        out[metric_key("rollout", "duration_s_mean", h)] = statistics.fmean(
            a.duration_seconds for a in attempts
        )
        fracs = [
            a.metrics["trainable_token_fraction"] for a in attempts if "trainable_token_fraction" in a.metrics
        ]
        if fracs:
            out[metric_key("fidelity", "trainable_token_fraction", h)] = statistics.fmean(fracs)
        # Structured-output calls: recorded, kept as context unless rows.train_constrained.
        out[metric_key("fidelity", "constrained_calls", h)] = float(
            sum(a.metrics.get("constrained_calls", 0.0) for a in attempts)
        )
        out[metric_key("rollout", "ungraded", h)] = float(sum(1 for a in attempts if a.reward is None))
    all_attempts = [a for g in groups for a in g.attempts]
    terms: dict[str, list[float]] = defaultdict(list)
    for a in all_attempts:
        for k, v in a.reward_terms.items():
            if v is not None:
                terms[k].append(v)
    for k, vs in terms.items():
        out[f"reward/{k}/mean"] = statistics.fmean(vs)
    for key, name in (("proxy_ms", "latency_ms_mean"), ("upstream_s", "upstream_s_mean")):
        values = [a.metrics[key] for a in all_attempts if key in a.metrics]
        if values:
            out[f"proxy/{name}"] = statistics.fmean(values)
    graded_all = [a.reward for a in all_attempts if a.reward is not None]
    if graded_all:
        out["reward/mean"] = statistics.fmean(graded_all)
        out["reward/std"] = statistics.pstdev(graded_all)
    return out


def _write_attempts(path: Path, attempts: list[AttemptOutcome]) -> None:
    append_jsonl(
        path,
        *({**{k: v for k, v in asdict(a).items() if k != "rows"}, "rows": len(a.rows)} for a in attempts),
    )


class GroupAdmission:
    """Decides what happens to each finished group and when an optimizer step's batch is ready.

    Stale groups (more than ``max_staleness`` policy versions behind) are dropped; groups with
    fewer than two graded attempts, or whose graded attempts produced no rows, are not trainable;
    ``max_consecutive_empty`` such groups in a row abort the run. With ``drop_no_signal``
    (``trainer.dynamic_sampling``) groups whose graded rewards are all equal are left out too.
    Trainable groups wait until their rows reach ``rows_per_step``; ``offer`` then returns the
    whole batch of groups — or, with ``max_groups_per_step``, once that many groups were drawn for
    the step and at least one has signal. A policy that always solves or always fails its tasks
    gives no signal at all, so no step can form: ``no_signal_patience`` such groups in a row (with
    ``drop_no_signal``) abort the run instead of drawing on.
    """

    def __init__(
        self,
        *,
        max_staleness: int,
        rows_per_step: int,
        max_consecutive_empty: int,
        stats: LoopStats,
        state: RolloutState,
        drop_no_signal: bool = False,
        max_groups_per_step: int | None = None,
        no_signal_patience: int | None = None,
    ) -> None:
        self.drop_no_signal = drop_no_signal
        self.no_signal_patience = no_signal_patience
        self.no_signal_streak: Counter[str] = Counter()  # kinds of the groups in a row without signal
        self.max_groups_per_step = max_groups_per_step
        self.drawn = 0  # groups offered since the last batch
        # Per harness, the groups left out since the last batch (logged with that step).
        self.dropped: Counter[str] = Counter()
        self.max_staleness = max_staleness
        self.rows_per_step = rows_per_step
        self.max_consecutive_empty = max_consecutive_empty
        self.stats = stats
        self.state = state
        self.pending: list[GroupOutcome] = []

    def offer(self, group: GroupOutcome, policy_version: int) -> list[GroupOutcome] | None:
        stats = self.stats
        stats.groups += 1
        self.drawn += 1
        stats.attempts += len(group.attempts)
        for a in group.attempts:
            stats.exit_reasons[a.exit_reason] += 1
        stats.rewards += [a.reward for a in group.attempts if a.reward is not None]
        gid = group.planned.group_id
        if policy_version - group.policy_version > self.max_staleness:
            stats.stale_dropped += 1
            self.state.mark(gid, "stale_dropped")
            return None
        kind = group.signal()
        stats.signal_kinds[kind] += 1
        if kind != "signal":
            stats.no_signal += 1
        if len(group.graded) < 2 or not any(a.rows for a in group.graded):
            stats.empty_groups += 1
            stats.consecutive_empty += 1
            self.state.mark(gid, "empty")
            if stats.consecutive_empty >= self.max_consecutive_empty:
                reasons = ", ".join(f"{k}={v}" for k, v in sorted(stats.exit_reasons.items()))
                raise RunAborted(
                    f"{stats.consecutive_empty} consecutive groups produced no trainable rows (attempt exits "
                    f"so far: {reasons}). Agents that never reach the model are a wiring failure (see each "
                    "attempt's stderr.txt and the proxy log); groups with fewer than 2 graded attempts give "
                    "no signal (see the grader reasons in attempts.jsonl)."
                )
            return None
        stats.consecutive_empty = 0
        if kind == "signal":
            self.no_signal_streak.clear()
        else:
            self.no_signal_streak[kind] += 1
        if self.drop_no_signal and kind != "signal":
            self._check_patience()
            stats.dropped_no_signal += 1
            self.dropped[group.planned.harness] += 1
            self.state.mark(gid, "no_signal")
            return self._cut_short()
        self.pending.append(group)
        if sum(len(a.rows) for g in self.pending for a in g.graded) < self.rows_per_step:
            return self._cut_short()
        return self._release()

    def _check_patience(self) -> None:
        streak = sum(self.no_signal_streak.values())
        if self.no_signal_patience is None or streak < self.no_signal_patience:
            return
        kinds = ", ".join(f"{n} {k.replace('_', '-')}" for k, n in sorted(self.no_signal_streak.items()))
        raise RunAborted(
            f"{streak} groups in a row had no learning signal ({kinds}): every attempt of a group got the "
            "same reward, so dynamic sampling left each out and no optimizer step can form. The policy solves "
            "every task or none at this temperature. Fix: tasks nearer its level, a higher "
            "sampling.temperature or a larger scheduler.group_size; trainer.dynamic_sampling=false trains "
            "such groups with advantage 0; trainer.dynamic_sampling_patience=null draws on. Checkpoints and "
            "rollout_state.json are kept: a rerun resumes from the last checkpoint."
        )

    def _cut_short(self) -> list[GroupOutcome] | None:
        """The batch so far, when the step has drawn its ``max_groups_per_step`` and has signal."""
        if self.max_groups_per_step is None or self.drawn < self.max_groups_per_step or not self.pending:
            return None
        self.stats.short_steps += 1
        return self._release()

    def _release(self) -> list[GroupOutcome]:
        batch, self.pending = self.pending, []
        self.drawn = 0
        return batch


def run_rl(run: RunConfig) -> float:
    return asyncio.run(_run_rl(run))


async def _run_rl(run: RunConfig) -> float:
    """Plan the schedule, build the trainer (every process), resume it, and on the main process
    serve and train; the other processes replay the main process's trainer calls."""
    from fineenvs.train.grpo import CapturedGRPOTrainer
    from fineenvs.train.lockstep import Lockstep

    assert isinstance(run.trainer, GRPOSettings)
    out = Path(str(run.output_dir))
    out.mkdir(parents=True, exist_ok=True)
    check_harnesses(run)  # before the trainer loads: a missing CLI fails in seconds, not after a 27B load
    plan = _plan(run)
    started = time.monotonic()
    # Every process builds the trainer (a collective under accelerate); only the main process
    # runs the engine, the proxy and the agents, and the others replay its trainer calls.
    trainer = CapturedGRPOTrainer(plan.model_dir, run.trainer, out / "trainer")
    lock = Lockstep(trainer)
    # Each process may have resolved its own timestamped Hydra directory: the main process's wins.
    loop = _RLLoop(run, run.trainer, trainer, lock, Path(lock.agree(str(out))), started)
    resume = loop.resume_trainer()
    if not lock.is_main:
        calls = await asyncio.to_thread(lock.follow)
        log.info("process %d replayed %d trainer calls", trainer.accelerator.process_index, calls)
        return 0.0
    state = loop.rollout_state(plan, resume)
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(lock.stop)
        await loop.serve(stack, plan, resume)
        await loop.train(plan, state)
    return _summary(run, loop.stats, loop.out, started)


@dataclass
class _Plan:
    """What the run will do, decided before the trainer loads."""

    tasks: list[Task]
    schedule: list[PlannedGroup]
    digest: str
    rows: RowOptions
    model_dir: Path


def _plan(run: RunConfig) -> _Plan:
    scheduler = run.scheduler
    tasks = select_tasks(run.tasks)
    names = tuple(run.harness)
    schedule = build_schedule(
        [task.task_id for task in tasks],
        HarnessMix(names, tuple(run.harness[n].weight for n in names)),
        group_size=scheduler.group_size,
        passes=scheduler.passes,
        selection=scheduler.harness_selection.value,
        seed=scheduler.seed,
    )
    assert isinstance(run.trainer, GRPOSettings)
    return _Plan(
        tasks,
        schedule,
        schedule_hash(schedule),
        row_options(run, run.trainer.token_budget),
        resolve_model_dir(run),
    )


class _RLLoop:
    """The main process's side of one RL run: resume, serve (engine, proxy, parity gate), then
    the step loop with its weight pushes, checkpoints and in-training evaluations."""

    settings: GRPOSettings

    def __init__(
        self,
        run: RunConfig,
        settings: GRPOSettings,
        trainer: CapturedGRPOTrainer,
        lock: Lockstep,
        out: Path,
        started: float,
    ) -> None:
        self.run, self.settings, self.trainer, self.lock, self.out = run, settings, trainer, lock, out
        self.started = started
        self.stats = LoopStats()
        self.state_path = out / "rollout_state.json"
        self.ckpt_root = out / "checkpoints"
        self.sync = effective_weight_sync(run)
        self.pushing = self.sync is not WeightSyncKind.none
        self.engine_dtype = engine_dtype(run)
        # vLLM loads pushed tensors by checkpoint names; the embedded engine by the model's own.
        self.checkpoint_names = self.sync in VLLM_WEIGHT_SYNCS
        self.gate: ParityGate | None = None  # the engine-trainer parity gate, once the engine runs
        self.runtime: JobRuntime | None = None
        self.logger: MetricLogger | None = None
        self.start_metrics: dict[str, float] = {}

    # -- resume ------------------------------------------------------------------------------

    def resume_trainer(self) -> Path | None:
        """Load the newest complete checkpoint into the trainer (every process); its path."""
        resume = latest_checkpoint(self.ckpt_root)
        if resume is not None:
            self.trainer.load_checkpoint(resume)
            self.stats.steps = self.trainer.global_step
        return resume

    def rollout_state(self, plan: _Plan, resume: Path | None) -> RolloutState:
        try:
            (self.out / "schedule.json").write_text(
                json.dumps({"hash": plan.digest, "groups": [asdict(g) for g in plan.schedule]})
            )
            # The rollout state that goes with the trainer's weights is the checkpoint's copy: groups
            # trained after the last checkpoint were lost with those updates and may run again.
            source = resume / "rollout_state.json" if resume else self.state_path
            state = RolloutState.load_or_new(source, plan.digest)
        except BaseException:
            self.lock.stop()  # release the other processes before failing
            raise
        if resume is not None:
            print(
                f"Resumed from {resume} (step {self.stats.steps}, {len(state.consumed)} groups consumed)",
                flush=True,
            )
        return state

    # -- serve -------------------------------------------------------------------------------

    async def serve(self, stack: contextlib.AsyncExitStack, plan: _Plan, resume: Path | None) -> None:
        """Engine and proxy up, the parity gate ready, the engine serving the trainer's weights."""
        run = self.run
        self.runtime = await stack.enter_async_context(
            job_runtime(
                run, self.out, model_dir=plan.model_dir, probe=Probe.require, check=False
            )  # checked above
        )
        engine = self.runtime.engine
        if self.pushing and engine.weight_sync is None:
            raise RunAborted(
                f"weight sync is {self.sync.value} but the {engine.kind} engine at {engine.url} has no weight "
                "transport: the trainer's updates would never reach it. Fix: engine.weight_sync=reload (vLLM) "
                "or http (embedded engine), or engine.weight_sync=none to train without pushing."
            )
        if run.engine.parity_gate and resume is not None and not self.pushing:
            # The fresh engine serves the base model and nothing gives it the checkpoint's weights.
            print(
                "Parity gate off for this resumed run: engine.weight_sync=none, so the engine serves the "
                "base model while the trainer resumed from a checkpoint; they are not meant to agree.",
                flush=True,
            )
        elif run.engine.parity_gate:
            self.gate = stack.enter_context(contextlib.closing(parity_gate(run, engine, self.out)))
            await asyncio.to_thread(self.gate.prepare, run.sampling.temperature)
        if self.pushing and resume is not None:
            # A fresh engine loaded the base model: give it the checkpoint's weights (and check them).
            self.start_metrics = await asyncio.to_thread(self.push_weights)
        else:
            if self.pushing:
                # Label the served weights with the trainer's version, so records carry numbers.
                assert engine.weight_sync is not None  # checked above: pushing needs a transport
                await asyncio.to_thread(engine.weight_sync.announce, self.trainer.policy_version)
            self.start_metrics = await asyncio.to_thread(self.check_parity)
        self.logger = stack.enter_context(
            MetricLogger(run.logger, self.out, run_name=run.logger.name or run.experiment or "rl", config=run)
        )

    def push_weights(self) -> dict[str, float]:
        """Push the trainer's weights, then check the engine serves them (the parity gate);
        returns the gate's figures. A failed push or check stops the run here, before the next
        optimizer step, with the checkpoints kept."""
        from fineenvs.engine.weights import WeightSyncError

        assert self.runtime is not None and self.runtime.engine.weight_sync is not None
        version = self.trainer.policy_version
        # The state dict in the engine's dtype: NCCL broadcasts it, reload and the embedded
        # engine stage it as a safetensors directory. A gather under FSDP: every process joins.
        weights = self.lock.call("state_dict", self.engine_dtype, self.checkpoint_names)
        try:
            self.runtime.engine.weight_sync.push(weights, version)
        except WeightSyncError as err:
            raise RunAborted(f"pushing the weights of version {version} to the engine failed: {err}") from err
        return self.check_parity()

    def check_parity(self) -> dict[str, float]:
        from fineenvs.engine.parity import ParityError

        if self.gate is None:
            return {}
        try:
            check = self.gate.check(
                self.trainer.policy_version, lambda seqs: self.lock.call("sequence_logprobs", seqs)
            )
        except ParityError as err:
            raise RunAborted(str(err)) from err
        print(check.line(), flush=True)
        self.stats.parity.append(check.mean_abs_diff)
        return dict(check.metrics())

    # -- train -------------------------------------------------------------------------------

    async def train(self, plan: _Plan, state: RolloutState) -> None:
        """Admit finished groups until a batch waits, then step; until max_steps or the schedule ends."""
        assert self.runtime is not None
        t, s = self.settings, self.run.scheduler
        runner = self.runtime.attempt_runner(
            plan.tasks, attempts_dir=self.out / "attempts", row_options=plan.rows
        )
        scheduler = RolloutScheduler(
            plan.schedule,
            runner,
            max_inflight=s.max_inflight,
            policy_version=lambda: self.trainer.policy_version,
            skip=set(state.consumed),
            infra_retries=s.infra_retries,
            on_lost=self.record_lost,
        )
        admission = GroupAdmission(
            max_staleness=s.max_staleness,
            rows_per_step=t.per_device_batch_size * t.gradient_accumulation_steps,
            max_consecutive_empty=s.max_consecutive_empty_groups,
            stats=self.stats,
            state=state,
            drop_no_signal=t.dynamic_sampling,
            max_groups_per_step=t.dynamic_sampling_max_groups if t.dynamic_sampling else None,
            no_signal_patience=t.dynamic_sampling_patience,
        )
        display = ProgressDisplay(t.max_steps, self.started)
        try:
            # aclosing: leaving the loop (max_steps, an error) stops the scheduler right here, while
            # engine and proxy still run, instead of at interpreter shutdown with attempts in flight.
            async with contextlib.aclosing(scheduler.groups()) as finished:
                async for group in finished:
                    _write_attempts(self.out / "attempts.jsonl", group.attempts)
                    batch = admission.offer(group, self.trainer.policy_version)
                    if batch is None:
                        continue
                    metrics = await self.step(batch, state)
                    pushed_now = False
                    if self.pushing and self.stats.steps % t.weight_sync_interval == 0:
                        metrics.update(await asyncio.to_thread(self.push_weights))
                        self.stats.weight_pushes += 1
                        pushed_now = True
                    metrics.update(self.loop_metrics(batch, admission, scheduler.inflight))
                    assert self.logger is not None
                    self.logger.log(metrics, step=self.stats.steps)
                    display.update(self.stats, metrics, scheduler.inflight)
                    if self.stats.steps % t.save_steps == 0 or self.stats.steps >= t.max_steps:
                        await self.checkpoint(state, pushed_now)
                    if self.stats.steps >= t.max_steps:
                        break
        finally:
            display.close()
            state.save(self.state_path)

    def record_lost(self, attempt: AttemptOutcome) -> None:
        """An attempt lost to the infrastructure, to be rerun: recorded and counted when it is lost
        (its group may still be unfinished when the run stops), never graded or trained."""
        _write_attempts(self.out / "attempts.jsonl", [attempt])
        self.stats.attempts += 1
        self.stats.infra_retried += 1
        self.stats.exit_reasons[attempt.exit_reason] += 1

    async def step(self, batch: list[GroupOutcome], state: RolloutState) -> dict[str, float]:
        """One optimizer step on the batch's rows; its metrics (with the start's parity figures once)."""
        stats = self.stats
        pending = _stamp_rows(batch, self.settings.scale_rewards)
        metrics: dict[str, float] = await asyncio.to_thread(self.lock.call, "step", pending)
        stats.steps = self.trainer.global_step
        stats.rows_trained += len(pending)
        stats.last_ratio = metrics.get("train/ratio")
        if stats.first_ratio is None:
            stats.first_ratio = stats.last_ratio
        for g in batch:
            state.mark(g.planned.group_id, "trained")
        metrics.update(self.start_metrics)
        self.start_metrics = {}
        metrics.update(advantage_metrics(pending, {g.planned.group_id: g.planned.harness for g in batch}))
        return metrics

    def loop_metrics(
        self, batch: list[GroupOutcome], admission: GroupAdmission, inflight: int
    ) -> dict[str, float]:
        stats = self.stats
        metrics = group_metrics(batch)
        for h, n in admission.dropped.items():
            metrics[metric_key("rollout", "groups_dropped_no_signal", h)] = float(n)
        admission.dropped.clear()
        metrics.update(
            {
                "rollout/groups_stale_dropped": float(stats.stale_dropped),
                "rollout/groups_no_signal": float(stats.no_signal),  # all so far
                "rollout/groups_dropped_no_signal": float(stats.dropped_no_signal),
                "rollout/steps_cut_short": float(stats.short_steps),
                "rollout/groups_all_correct": float(stats.signal_kinds["all_correct"]),
                "rollout/groups_all_zero": float(stats.signal_kinds["all_zero"]),
                "rollout/groups_empty": float(stats.empty_groups),
                "rollout/attempts_rerun_after_infra_failure": float(stats.infra_retried),
                "rollout/inflight": float(inflight),
                "train/policy_version": float(self.trainer.policy_version),
            }
        )
        return metrics

    async def checkpoint(self, state: RolloutState, pushed_now: bool) -> None:
        """Save the trainer and the rollout state that goes with it; evaluate when due."""
        steps = self.stats.steps
        ckpt = self.ckpt_root / f"step-{steps}"
        await asyncio.to_thread(self.lock.call, "save_checkpoint", ckpt)
        state.save(ckpt / "rollout_state.json")
        (ckpt / "COMPLETE").write_text("ok\n")
        state.save(self.state_path)
        if not in_training_eval_due(steps, self.settings):
            return
        assert self.runtime is not None and self.logger is not None
        if self.pushing and not pushed_now:
            # The evaluation must see this checkpoint's weights, not the last pushed ones.
            self.logger.log(await asyncio.to_thread(self.push_weights), step=steps)
            self.stats.weight_pushes += 1
        from fineenvs.jobs.eval import aevaluate_checkpoint

        engine = self.runtime.engine
        await aevaluate_checkpoint(
            self.run,
            ckpt,
            steps,
            engine_url=engine.url,
            proxy_url=self.runtime.proxy_url,
            served_model=engine.served_model_name,
            logger=self.logger,
            remote=self.runtime.remote,
        )


def parity_gate(run: RunConfig, engine: EngineHandle, out: Path) -> ParityGate:
    """The engine-trainer parity gate for this run's engine (``fineenvs.engine.parity``)."""
    from fineenvs.engine.parity import ParityGate, tolerance

    assert isinstance(run.trainer, GRPOSettings)
    allowed = run.engine.parity_tolerance or tolerance(engine_dtype(run), run.trainer.dtype)
    replicas = engine.replicas.serving_urls if engine.replicas is not None else None
    return ParityGate(
        engine.url, engine.served_model_name, tolerance=allowed, out_dir=out / "parity", replicas=replicas
    )


def in_training_eval_due(step: int, t: GRPOSettings) -> bool:
    """Whether the in-training hook evaluates the checkpoint saved at ``step``."""
    return step % t.eval_steps == 0 and (t.eval_at_end or step < t.max_steps)


def advantage_metrics(rows: list[TrainRow], harness_of: dict[str, str]) -> dict[str, float]:
    """Rows of one step trained with advantage 0 (no signal), per harness and in all."""
    zero: Counter[str] = Counter()
    total: Counter[str] = Counter()
    for r in rows:
        h = harness_of.get(r.group_id, "unknown")
        total[h] += 1
        zero[h] += abs(r.advantage) < 1e-12
    out = {metric_key("train", "rows_zero_advantage", h): float(zero[h]) for h in total}
    out.update({metric_key("train", "rows", h): float(total[h]) for h in total})
    out["train/rows_zero_advantage"] = float(sum(zero.values()))
    return out


def _stamp_rows(groups: list[GroupOutcome], scale: str) -> list[TrainRow]:
    """Every trainable row of every graded attempt, stamped with its attempt's advantage."""
    from fineenvs.train.train_rows import TrainRow, group_advantages, reward_std

    batch_std = reward_std([a.reward for g in groups for a in g.attempts]) if scale == "batch" else None
    rows = []
    for g in groups:
        advantages = group_advantages([a.reward for a in g.attempts], scale, batch_std=batch_std)
        for a, adv in zip(g.attempts, advantages, strict=True):
            if adv is None:
                continue
            rows += [
                TrainRow.from_row(
                    r,
                    advantage=adv,
                    attempt_id=a.attempt_id,
                    group_id=a.group_id,
                    # Staleness from the engine's own record of the weights that sampled the row,
                    # else from the policy version the attempt started under.
                    policy_version=_row_version(r, a.policy_version),
                )
                for r in a.rows
            ]
    return rows


def _row_version(row: object, fallback: int) -> int:
    version = getattr(row, "weight_version", None)
    return version if isinstance(version, int) else fallback


class ProgressDisplay:
    """Live terminal progress (rich) on a TTY: step, groups in flight, reward, ratio, ETA; one plain
    line per step otherwise (logs, CI)."""

    def __init__(self, max_steps: int, started: float) -> None:
        self.max_steps = max_steps
        self.started = started
        self._progress: Progress | None = None
        if sys.stdout.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("step {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
            )
            self._task = self._progress.add_task("rl", total=max_steps, info="starting agents")
            self._progress.start()

    def update(self, stats: LoopStats, metrics: JsonObject, inflight: int) -> None:
        reward, ratio = metrics.get("reward/mean"), metrics.get("train/ratio")
        info = (
            f"groups {stats.groups} | attempts {stats.attempts} ({inflight} in flight) | "
            f"reward {'-' if reward is None else f'{reward:.3f}'} | ratio {'-' if ratio is None else f'{ratio:.5f}'}"
        )
        if self._progress is not None:
            self._progress.update(self._task, completed=stats.steps, info=info)
            return
        elapsed = time.monotonic() - self.started
        eta = elapsed / max(stats.steps, 1) * max(self.max_steps - stats.steps, 0)
        print(
            f"step {stats.steps}/{self.max_steps} | {info} | elapsed {elapsed:.0f}s | eta {eta:.0f}s",
            flush=True,
        )

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


def _summary(run: RunConfig, stats: LoopStats, out: Path, started: float) -> float:
    mean_reward = statistics.fmean(stats.rewards) if stats.rewards else 0.0
    summary = {
        "steps": stats.steps,
        "groups": stats.groups,
        "attempts": stats.attempts,
        "rows_trained": stats.rows_trained,
        "mean_reward": mean_reward,
        "first_ratio": stats.first_ratio,
        "last_ratio": stats.last_ratio,
        "parity_checks": len(stats.parity),
        "parity_max_mean_abs_diff": max(stats.parity) if stats.parity else None,
        "stale_groups_dropped": stats.stale_dropped,
        "groups_without_signal": stats.no_signal,
        "groups_by_signal": dict(stats.signal_kinds),
        "groups_dropped_without_signal": stats.dropped_no_signal,
        "steps_cut_short": stats.short_steps,
        "groups_without_rows": stats.empty_groups,
        "weight_pushes": stats.weight_pushes,
        "attempt_exits": dict(stats.exit_reasons),
        "attempts_rerun_after_infra_failure": stats.infra_retried,
        "seconds": round(time.monotonic() - started, 1),
        "output_dir": str(out),
    }
    why = zero_reward_reason(run, stats)
    if why:
        summary["why_reward_is_0"] = why
    write_summary(out, "fineenvs run summary", summary)
    return mean_reward


def zero_reward_reason(run: RunConfig, stats: LoopStats) -> str | None:
    """Why a run's reward stayed 0, when it did, and where to see one that learns."""
    if not stats.rewards or any(r > 0 for r in stats.rewards):
        return None
    if run.model.source is ModelSource.tiny:
        cause = (
            f"{run.model.path} is a randomly initialised tiny model: it cannot solve a task, so every "
            "group is all-zero and every row trains with advantage 0 (no learning signal). This run "
            "shows the machinery works, not learning."
        )
    else:
        cause = (
            "no attempt was graded correct, so every group is all-zero and every row trained with "
            "advantage 0 (no learning signal); see the grader reasons in attempts.jsonl."
        )
    return (
        cause + " For the loop with real rewards (a student warm-started from a teacher's rollouts, then RL):"
        " +experiment=mini_repro (experiments/mini_repro/README.md)."
    )
