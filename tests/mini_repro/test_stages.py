"""The mini-reproduction's stages compose into valid runs of the real jobs (no run is started)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from fineenvs.config import (
    ConfigError,
    EngineKind,
    GRPOSettings,
    HarnessSelection,
    Job,
    ModelSource,
    RunConfig,
    SFTSettings,
    to_run_config,
)
from fineenvs.jobs.recipe import run_recipe
from fineenvs.jobs.rl import in_training_eval_due
from fineenvs.paths import CONF_DIR
from fineenvs.results import wilson
from fineenvs_recipes.mini_repro.recipe import CHECKPOINT_STAGES, STAGES, stage_commands, summary_table


def _load(*overrides: str) -> RunConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+experiment=mini_repro", *overrides])
    return to_run_config(cfg)


def test_every_stage_is_a_valid_run_of_the_real_job(tmp_path: Path) -> None:
    run = _load(f"output_dir={tmp_path}")
    assert run.job is Job.recipe and list(run.harness) == run.recipe.harnesses
    base = tmp_path / "base" / "checkpoints" / "step-9"
    ckpts = {s: tmp_path / s / "checkpoints" / "step-9" for s in CHECKPOINT_STAGES}
    commands = stage_commands(run.recipe, tmp_path, ckpts)
    assert set(commands) == set(STAGES) - {"report"}
    assert run.recipe.unseen_harnesses == ["codex"] and "codex" not in run.recipe.harnesses
    runs = {
        name: [_load(*o, f"output_dir={tmp_path / name}") for o in overrides]
        for name, overrides in commands.items()
    }
    teacher = runs["teacher"]
    assert [t.job for t in teacher] == [Job.collect_teacher] * 2
    assert all(t.engine.policy == "expert" and t.engine.kind is EngineKind.transformers for t in teacher)
    assert list(teacher[0].harness) == ["pi"] and list(teacher[1].harness) == ["mini_swe_agent", "opencode"]
    assert teacher[0].tasks.limit is None and teacher[1].tasks.limit == 48  # 24 for sft_mix + 24 for the base
    assert teacher[0].tasks.name == "mini" and teacher[0].tasks.split == "train"
    (b,) = runs["base"]
    assert b.job is Job.sft and isinstance(b.trainer, SFTSettings) and b.model.source is ModelSource.tiny
    # The base's data: every Pi rollout and the few of each other harness (base_sees_mix) but the
    # first 24 of the other harnesses, which are sft_mix's; one example per rollout, in the student
    # the recipe is sized for, agents in the bwrap sandbox.
    assert list(b.harness) == ["pi", "mini_swe_agent", "opencode"] and b.trainer.merge_turns
    assert b.trainer.rollout_slices == {"mini_swe_agent": [24, 48], "opencode": [24, 48]}
    (b_l,) = [  # run L's recipe: Pi's first 24 held out of the base too
        _load(*o, f"output_dir={tmp_path / 'bl'}")
        for o in stage_commands(replace(run.recipe, hold_out_base_harness=True), tmp_path, ckpts)["base"]
    ]
    assert b_l.trainer.rollout_slices == {"pi": [24], "mini_swe_agent": [24, 48], "opencode": [24, 48]}
    assert b.trainer.teacher_dir == str(tmp_path / "teacher") and b.model.name == "tiny_agent"
    assert all(r.scheduler.sandbox.value == "bwrap" for rs in runs.values() for r in rs)
    (b_one,) = [
        _load(*o, f"output_dir={tmp_path / 'b1'}")
        for o in stage_commands(replace(run.recipe, base_sees_mix=False), tmp_path, ckpts)["base"]
    ]
    assert list(b_one.harness) == ["pi"]
    # Without the sft_mix stage (the learning test's recipe) nothing is held out of the base.
    lt = replace(
        run.recipe, base_sees_mix=False, harnesses=["pi"], stages=["teacher", "base", "rl_one", "eval"]
    )
    lt_runs = stage_commands(lt, tmp_path, ckpts)
    assert len(lt_runs["teacher"]) == 1 and "tasks.limit=null" in lt_runs["teacher"][0]
    (b_lt,) = [_load(*o, f"output_dir={tmp_path / 'blt'}") for o in lt_runs["base"]]
    assert b_lt.trainer.rollout_slices == {} and list(b_lt.harness) == ["pi"]
    mix = ["pi", "mini_swe_agent", "opencode"]
    for name, harnesses in (("rl_one", ["pi"]), ("rl_mix", mix), ("rl_mix_nobonus", mix)):
        (r,) = runs[name]
        assert r.job is Job.rl and isinstance(r.trainer, GRPOSettings) and r.engine.policy == "model"
        assert r.model.source is ModelSource.local and r.model.path == str(base)
        assert list(r.harness) == harnesses and r.eval.split == "eval" and r.tasks.split == "train"
        assert r.sampling.temperature == 0.8 and r.sampling.top_p == 1.0 and r.trainer.dynamic_sampling
        # The bonus's control differs from rl_mix in the reward alone.
        bonus = (
            {"correctness": 1.0} if name == "rl_mix_nobonus" else {"correctness": 1.0, "tool_efficiency": 0.1}
        )
        assert r.reward.terms == bonus
        # The learning test's RL (run K) but for the learning rate: groups of 8, all in flight at
        # once, 24 rows per step, a step ends after 12 groups drawn; lr 3e-4 across the mix and
        # 1e-4 in one harness (the test: 1e-4 in both).
        assert r.trainer.dynamic_sampling_max_groups == 12
        assert r.scheduler.harness_selection is HarnessSelection.shuffled  # not tied to the templates
        assert r.scheduler.group_size == 8 and r.scheduler.max_inflight == 8
        assert r.trainer.per_device_batch_size * r.trainer.gradient_accumulation_steps == 24
        assert r.trainer.learning_rate == (1e-4 if name == "rl_one" else 3e-4)
        # In-training evaluations at step 6 only: the eval stage measures the final checkpoint.
        assert r.trainer.eval_steps == 6 and not r.trainer.eval_at_end and r.trainer.max_steps == 12
        assert [k for k in range(1, 13) if in_training_eval_due(k, r.trainer)] == [6]
        on = replace(r.trainer, eval_at_end=True)  # the default: the last step is evaluated too
        assert [k for k in range(1, 13) if in_training_eval_due(k, on)] == [6, 12]
    # rl_one_harness moves rl_one alone into that harness; the base, the teacher and rl_mix stay.
    elsewhere = stage_commands(replace(run.recipe, rl_one_harness="opencode"), tmp_path, ckpts)
    (one_oc,) = [_load(*o, f"output_dir={tmp_path / 'oc'}") for o in elsewhere["rl_one"]]
    assert list(one_oc.harness) == ["opencode"] and one_oc.trainer.learning_rate == 1e-4
    assert one_oc.model.path == str(base)
    assert {k: v for k, v in elsewhere.items() if k != "rl_one"} == {
        k: v for k, v in commands.items() if k != "rl_one"
    }
    (old,) = [  # runs C-E's setting: groups of 4, 8 rows per step, no cap
        _load(*o, f"output_dir={tmp_path / 'old'}")
        for o in stage_commands(
            replace(run.recipe, group_size=4, rl_rows_per_step=8, rl_max_groups_per_step=None),
            tmp_path,
            ckpts,
        )["rl_one"]
    ]
    assert old.trainer.dynamic_sampling_max_groups is None
    assert old.scheduler.group_size == 4 and old.scheduler.max_inflight == 4
    assert old.trainer.per_device_batch_size * old.trainer.gradient_accumulation_steps == 8
    (s,) = runs["sft_mix"]
    assert s.model.path == str(base) and s.trainer.max_rollouts_per_harness is None
    assert s.trainer.rollout_slices == {h: [0, 24] for h in ("pi", "mini_swe_agent", "opencode")}
    assert s.trainer.learning_rate == run.recipe.sft_mix_learning_rate
    assert s.trainer.num_train_epochs == run.recipe.sft_mix_epochs
    (e,) = runs["eval"]
    assert e.job is Job.eval and e.eval.checkpoints == [str(p) for p in ckpts.values()]
    assert e.eval.split == "eval" and list(e.harness) == mix
    # The unseen harness: every checkpoint on the same tasks, in a stage of its own.
    (u,) = runs["eval_unseen"]
    assert u.job is Job.eval and u.eval.checkpoints == e.eval.checkpoints and list(u.harness) == ["codex"]
    assert (u.eval.split, u.eval.limit) == (e.eval.split, e.eval.limit) == ("eval", 36)
    # The control is the same RL run to the letter but for the reward.
    nobonus, with_bonus = commands["rl_mix_nobonus"][0], commands["rl_mix"][0]
    assert [o for o in nobonus if o not in with_bonus] == ["reward=correctness"]
    assert [o for o in with_bonus if o not in nobonus] == []
    # Without unseen harnesses there is no eval_unseen stage; the learning test's stages are unchanged.
    assert "eval_unseen" not in stage_commands(replace(run.recipe, unseen_harnesses=[]), tmp_path, ckpts)
    lt_ckpts = {s: ckpts[s] for s in ("base", "rl_one")}
    lt_eval = stage_commands(lt, tmp_path, lt_ckpts)["eval"][0]
    assert f"eval.checkpoints=[{ckpts['base']},{ckpts['rl_one']}]" in lt_eval and "harness=[pi]" in lt_eval


def test_the_expert_never_trains_and_bad_stage_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="engine.policy=expert"):
        _load("job=rl", "engine.policy=expert")
    with pytest.raises(ConfigError, match="engine.policy is 'oracle'"):
        _load("job=eval", "engine.policy=oracle")
    with pytest.raises(ConfigError, match="max_rollouts_per_harness must be >= 1"):
        _load("job=sft", "trainer=sft", "trainer.max_rollouts_per_harness=0")
    with pytest.raises(ConfigError, match=r"rollout_slices.pi=\[24, 24\] is not a slice.*Fix"):
        _load("job=sft", "trainer=sft", "+trainer.rollout_slices.pi=[24,24]")
    with pytest.raises(ConfigError, match="names 'codex', which is not among this run's harnesses"):
        _load("job=sft", "trainer=sft", "+trainer.rollout_slices.codex=[0,4]")


def test_the_recipes_seed_reaches_every_stage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fineenvs_recipes.mini_repro import recipe as mini_repro

    extras: list[list[str]] = []

    def fake_stage(name: str, runs: list[list[str]], out: Path, extra: list[str]) -> float:
        extras.append(extra)
        stage = [_load(*o, *extra, f"output_dir={out / name}") for o in runs]
        assert {r.seed for r in stage} == {3} and {r.sampling.temperature for r in stage} == {0.5}
        return 1.0

    monkeypatch.setattr(mini_repro, "_run_stage", fake_stage)
    run = _load(
        f"output_dir={tmp_path}",
        "seed=3",
        "recipe.stages=[teacher]",
        "recipe.overrides=['sampling.temperature=0.5']",
    )
    run_recipe(run)
    assert extras == [["seed=3", "sampling.temperature=0.5"]]
    with pytest.raises(ConfigError, match=r"recipe.overrides has \['seed=5'\].*Fix: seed=<n>"):
        _load(f"output_dir={tmp_path}", "recipe.overrides=['seed=5']")


def test_a_finished_stage_is_reused_only_with_the_settings_that_finished_it(tmp_path: Path) -> None:
    from fineenvs_recipes.mini_repro import recipe as mini_repro

    teacher = tmp_path / "teacher"
    teacher.mkdir()
    run = _load(f"output_dir={tmp_path}", "seed=0", "recipe.stages=[teacher]")
    runs = stage_commands(run.recipe, tmp_path, {})["teacher"]
    (teacher / mini_repro.DONE).write_text(json.dumps({"seconds": 1.0, "runs": runs, "extra": ["seed=0"]}))
    run_recipe(run)  # the same settings: resumed, nothing run
    with pytest.raises(
        mini_repro.StageFailed, match=r"finished with other settings: \['seed=0'\].*\['seed=1'\].*Fix"
    ):
        run_recipe(_load(f"output_dir={tmp_path}", "seed=1", "recipe.stages=[teacher]"))
    with pytest.raises(mini_repro.StageFailed, match="tasks.limit=30"):  # another teacher command
        run_recipe(_load(f"output_dir={tmp_path}", "recipe.teacher_tasks=30", "recipe.stages=[teacher]"))
    (teacher / mini_repro.DONE).write_text(json.dumps({"seconds": 1.0}))  # written before it recorded them
    run_recipe(_load(f"output_dir={tmp_path}", "seed=1", "recipe.stages=[teacher]"))


def test_a_run_finished_before_the_control_existed_runs_it_and_asks_before_extending_its_eval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run folder of the old defaults (no rl_mix_nobonus, no eval_unseen) under the new ones: the
    finished stages are reused (their commands did not change), the control runs, and the
    evaluation, which now also lists the control's checkpoint, is refused with the way to extend it."""
    from fineenvs_recipes.mini_repro import recipe as mini_repro

    run = _load(f"output_dir={tmp_path}", "seed=0")
    ckpts = {s: tmp_path / s / "checkpoints" / "step-9" for s in CHECKPOINT_STAGES}
    new = stage_commands(run.recipe, tmp_path, ckpts)
    old_ckpts = {s: p for s, p in ckpts.items() if s != "rl_mix_nobonus"}
    old = stage_commands(run.recipe, tmp_path, old_ckpts)
    for stage in ("teacher", "base", "rl_one", "rl_mix", "sft_mix"):
        assert old[stage] == new[stage], stage  # the old stages' commands are what they were
    for stage in ("teacher", "base", "rl_one", "rl_mix", "sft_mix", "eval"):
        (tmp_path / stage).mkdir()
        (tmp_path / stage / mini_repro.DONE).write_text(
            json.dumps({"seconds": 1.0, "runs": old[stage], "extra": ["seed=0"]})
        )

    def checkpoint(stage: str) -> None:  # what a finished stage leaves: its summary names its checkpoint
        ckpts[stage].mkdir(parents=True)
        (tmp_path / stage / "summary.json").write_text(json.dumps({"checkpoint": str(ckpts[stage])}))

    for stage in old_ckpts:
        checkpoint(stage)
    ran: list[str] = []

    def fake_stage(name: str, runs: list[list[str]], out: Path, extra: list[str]) -> float:
        ran.append(name)
        (tmp_path / name).mkdir()
        checkpoint(name)
        return 1.0

    monkeypatch.setattr(mini_repro, "_run_stage", fake_stage)
    with pytest.raises(
        mini_repro.StageFailed, match=r"stage eval .* other settings.*delete .*eval/STAGE_DONE and rerun"
    ):
        run_recipe(run)
    assert ran == ["rl_mix_nobonus"]


def test_rows_per_step_must_be_whole_passes(tmp_path: Path) -> None:
    """Bad knobs fail at compose time (``dry_run=true`` shows them), before any stage runs."""
    with pytest.raises(ConfigError, match="rl_rows_per_step=10.*Fix: a multiple of 4"):
        _load(f"output_dir={tmp_path}", "recipe.rl_rows_per_step=10")
    with pytest.raises(ConfigError, match="teacher_tasks=24 leaves the base no pi rollouts.*Fix"):
        _load(f"output_dir={tmp_path}", "recipe.teacher_tasks=24", "recipe.hold_out_base_harness=true")
    with pytest.raises(ConfigError, match="teacher_tasks=12 is below sft_mix_tasks=24.*Fix"):
        _load(f"output_dir={tmp_path}", "recipe.teacher_tasks=12")
    with pytest.raises(ConfigError, match=r"stages has \['tune'\]; choose from"):
        _load(f"output_dir={tmp_path}", "recipe.stages=[teacher,tune]")
    with pytest.raises(ConfigError, match=r"unseen_harnesses has \['opencode'\].*Fix"):
        _load(f"output_dir={tmp_path}", "recipe.unseen_harnesses=[opencode]")
    with pytest.raises(
        ConfigError, match=r"teacher_habit='peek' is not a habit.*Fix: one of \['look', 'verify'\]"
    ):
        _load(f"output_dir={tmp_path}", "recipe.teacher_habit=peek")
    with pytest.raises(ConfigError, match=r"rl_one_harness=codex is not in recipe.harnesses.*Fix"):
        _load(f"output_dir={tmp_path}", "recipe.rl_one_harness=codex")
    with pytest.raises(ConfigError, match=r"rl_one_learning_rate=0.0: a learning rate must be above 0.*Fix"):
        _load(f"output_dir={tmp_path}", "recipe.rl_one_learning_rate=0")
    assert not (tmp_path / "teacher").exists()


def test_the_teacher_habit_chooses_the_teachers_scripted_policy(tmp_path: Path) -> None:
    for habit, policy in (("verify", "expert"), ("look", "expert_look")):
        run = _load(f"output_dir={tmp_path}", f"recipe.teacher_habit={habit}")
        commands = stage_commands(run.recipe, tmp_path, {})
        teacher = [_load(*o, f"output_dir={tmp_path / 'teacher'}") for o in commands["teacher"]]
        assert [t.engine.policy for t in teacher] == [policy, policy]


def test_wilson_interval_and_table(tmp_path: Path) -> None:
    lo, hi = wilson(9, 18)
    assert 0.29 < lo < 0.30 and 0.70 < hi < 0.71  # the textbook value for 9/18
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == 1.0
    keys = [str(tmp_path / "base" / "ck"), str(tmp_path / "rl_one" / "ck")]
    cell = {"solved": 3, "tasks": 6}
    results = {
        "harnesses": ["pi"],
        "tasks": 6,
        "checkpoints": keys,
        "cells": {keys[0]: {"pi": cell}, keys[1]: {"pi": {"solved": 6, "tasks": 6}}},
        "overall": {keys[0]: 0.5, keys[1]: 1.0},
        "co_solved": {f"{keys[1]} vs {keys[0]}": {"cells": 3, "mean_tool_calls_base": 2.0,
                                                   "mean_tool_calls": 1.0, "reduction": 0.5}},
    }  # fmt: skip
    (tmp_path / "eval" / "eval").mkdir(parents=True)
    (tmp_path / "eval" / "eval" / "results.json").write_text(json.dumps(results))
    # The paired table comes from the attempt records: rl_one solved t3-t5 where base did not, lost none.
    records = [
        {"checkpoint": key, "task_id": f"t{i}", "harness": "pi", "try_index": 0, "attempt_id": f"{n}-t{i}",
         "reward": 1.0 if (i < 3 or n == "rl_one") else 0.0, "tool_calls": 2 if n == "base" else 1}
        for n, key in zip(["base", "rl_one"], keys, strict=True) for i in range(6)
    ]  # fmt: skip
    (tmp_path / "eval" / "eval" / "attempts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in records))
    table = summary_table(tmp_path)
    assert "| base | 0.50 [0.19, 0.81] | 0.50 [0.19, 0.81] |" in table
    assert "| rl_one vs base | 3 / 0 (p = 0.12) | 3 / 0 (p = 0.12) |" in table
    assert "| rl_one | 1.00 [0.61, 1.00]" in table
    # Co-solved: t0-t2, 2 calls for the base and 1 for rl_one on each.
    assert (
        "| rl_one vs base | 3 cells: 2.00 → 1.00, -50 % [-50, -50] | 3 cells: 2.00 → 1.00, -50 % [-50, -50] |"
        in table
    )


def test_the_recipe_on_vllm_serves_the_student_with_vllm_and_the_teacher_with_its_expert(
    tmp_path: Path,
) -> None:
    """``+experiment=mini_repro engine=vllm``: the RL and evaluation stages run vLLM (its CPU build
    on a CPU machine) with the prefix cache on; the teacher stays the embedded engine's scripted
    expert, the SFT stages start no engine; with the embedded engine nothing is added."""
    from fineenvs_recipes.mini_repro.recipe import engine_overrides

    run = _load("engine=vllm", f"output_dir={tmp_path}")
    engine = engine_overrides(run)
    assert engine == ["engine=vllm", "engine.enable_prefix_caching=true"]
    assert engine_overrides(_load(f"output_dir={tmp_path}")) == []
    ckpts = {s: tmp_path / s / "checkpoints" / "step-9" for s in CHECKPOINT_STAGES}
    commands = stage_commands(run.recipe, tmp_path, ckpts, engine)
    for name, overrides in commands.items():
        for o in overrides:
            stage = _load(*o, f"output_dir={tmp_path / name}")
            served_by_vllm = name in ("rl_one", "rl_mix", "rl_mix_nobonus", "eval", "eval_unseen")
            assert (stage.engine.kind is EngineKind.vllm) is served_by_vllm, name
            if served_by_vllm:
                assert stage.engine.enable_prefix_caching and stage.model.name == "tiny_agent"
    (ev,) = [_load(*o, f"output_dir={tmp_path / 'ev'}") for o in commands["eval"]]
    assert ev.engine.weight_sync.value == "none"
