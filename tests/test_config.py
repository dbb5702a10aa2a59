"""Every recipe composes and validates, carries the published numbers, and bad overrides fail with
the promised messages."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError

from fineenvs.config import (
    ApiFormat,
    ConfigError,
    EngineKind,
    GRPOSettings,
    Job,
    ModelFamily,
    RunConfig,
    SFTSettings,
    to_run_config,
)
from fineenvs.paths import CONF_DIR, REPO_ROOT
from fineenvs.plan import describe_plan, preflight
from fineenvs.tasks import TaskError
from fineenvs.tasks.selection import select_tasks

EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
ALL_HARNESSES = sorted(
    p.stem for p in (CONF_DIR / "harness").glob("*.yaml") if p.stem not in ("all", "paper_mix")
)
PAPER_MIX = {"opencode", "claude_code", "codex", "mini_swe_agent"}


def load(*overrides: str) -> RunConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    return to_run_config(cfg)


def test_all_recipes_exist() -> None:
    expected = {
        "rl_multi",
        "rl_opencode",
        "sft_multi",
        "sft_opencode",
        "qwen_rl_multi",
        "qwen_rl_opencode",
        "qwen_rl_opencode_standalone",
        "smoke",
    }
    assert expected <= set(EXPERIMENTS)
    for name in expected:
        assert (REPO_ROOT / "experiments" / name / "README.md").is_file(), name


def test_every_adapter_has_a_config_option() -> None:
    """conf/harness/<name>.yaml exists for exactly the registered adapters (all.yaml lists them all)."""
    from fineenvs.harnesses import HARNESSES

    assert ALL_HARNESSES == sorted(HARNESSES)
    assert sorted(load("harness=all").harness) == ALL_HARNESSES


@pytest.mark.parametrize("experiment", EXPERIMENTS)
@pytest.mark.parametrize("harness", [None, "all"])
def test_every_experiment_composes(experiment: str, harness: str | None) -> None:
    first_line = (CONF_DIR / "experiment" / f"{experiment}.yaml").read_text().splitlines()[1]
    overrides = [f"+experiment={experiment}"] + ([f"harness={harness}"] if harness else [])
    if "trainer.teacher_dir=" in first_line:  # a key the Run line says to give (validation asks for it)
        overrides.append("trainer.teacher_dir=/path/to/teacher")
    run = load(*overrides)
    assert run.experiment == experiment
    if harness == "all":
        assert sorted(run.harness) == ALL_HARNESSES
    plan = describe_plan(run)
    for name in run.harness:
        assert f"    {name}: " in plan
    assert first_line.startswith("# Run:") and f"+experiment={experiment}" in first_line


def test_published_numbers_rl_multi() -> None:
    run = load("+experiment=rl_multi")
    assert run.job is Job.rl
    assert run.model.path == "LiquidAI/LFM2.5-2.6B" and run.model.family is ModelFamily.lfm2
    assert run.engine.kind is EngineKind.vllm
    assert set(run.harness) == PAPER_MIX
    t = run.trainer
    assert isinstance(t, GRPOSettings)
    assert (t.learning_rate, t.lr_scheduler_type, t.warmup_steps, t.max_steps) == (3e-6, "constant", 0, 1000)
    assert (t.per_device_batch_size, t.gradient_accumulation_steps) == (4, 4)
    assert (t.token_budget, t.save_steps, t.eval_steps) == (40960, 50, 100)
    s = run.scheduler
    assert (s.group_size, s.max_inflight, s.max_staleness, s.max_model_calls) == (8, 32, 4, 17)
    assert s.attempt_timeout_seconds == 600 and s.harness_selection.value == "rotation"
    assert (run.sampling.temperature, run.sampling.top_p, run.sampling.top_k, run.sampling.min_p) == (
        0.8,
        1.0,
        -1,
        0.0,
    )
    assert run.sampling.max_tokens == 4096
    assert run.proxy.max_model_calls == 17
    assert run.reward.terms == {"correctness": 1.0, "tool_efficiency": 0.1} and run.reward.tool_budget == 15
    assert run.tasks.name == "smoldataenvs" and run.tasks.subset == "published_1000"
    assert run.harness["codex"].api_format is ApiFormat.openai_responses
    assert run.harness["claude_code"].api_format is ApiFormat.anthropic_messages


def test_published_numbers_other_recipes() -> None:
    oc = load("+experiment=rl_opencode")
    assert set(oc.harness) == {"opencode"} and oc.model.name == "lfm2_5_2_6b"
    for name, harnesses in (("sft_multi", PAPER_MIX), ("sft_opencode", {"opencode"})):
        sft = load(f"+experiment={name}", "trainer.teacher_dir=/path/to/teacher")
        assert sft.job is Job.sft and set(sft.harness) == harnesses
        assert isinstance(sft.trainer, SFTSettings)
        t = sft.trainer
        assert (t.num_train_epochs, t.learning_rate) == (2, 3e-6)
        assert t.per_device_batch_size * t.gradient_accumulation_steps == 8
    for name, harnesses in (
        ("qwen_rl_multi", PAPER_MIX),
        ("qwen_rl_opencode", {"opencode"}),
        ("qwen_rl_opencode_standalone", {"opencode"}),
    ):
        q = load(f"+experiment={name}")
        assert q.model.path == "Qwen/Qwen3.5-2B" and q.model.family is ModelFamily.qwen3_5
        assert q.model.tool_call_parser == "qwen3_xml"
        assert q.reward.terms == {"correctness": 1.0}, "the Qwen runs used correctness only"
        assert set(q.harness) == harnesses and q.sampling.max_tokens == 16384
    teacher = load("+experiment=collect_teacher")
    assert teacher.model.path == "Qwen/Qwen3.8-27B" and teacher.job is Job.collect_teacher
    assert isinstance(teacher.trainer, SFTSettings) and teacher.trainer.teacher_attempts_per_task == 3


def test_smoke_is_cpu_only() -> None:
    run = load("+experiment=smoke")
    assert run.engine.kind is EngineKind.transformers and run.model.name == "tiny_qwen"
    assert run.tasks.name == "demo"
    assert not [p for p in preflight(run) if "GPU" in p]


def test_command_line_harness_beats_experiment_default() -> None:
    assert set(load("+experiment=rl_multi", "harness=opencode").harness) == {"opencode"}
    assert set(load("+experiment=rl_opencode", "harness=paper_mix").harness) == PAPER_MIX
    assert set(load("+experiment=rl_multi", "harness=[codex,pi]").harness) == {"codex", "pi"}


def test_sft_trainer_refuses_grpo_keys() -> None:
    with pytest.raises((ConfigCompositionException, ConfigKeyError)) as err:
        load("trainer=sft", "trainer.epsilon_high=0.28")
    assert "epsilon_high" in str(err.value) or "epsilon_high" in str(err.value.__cause__)


def test_unknown_task_subset_names_the_known_ones() -> None:
    run = load("+experiment=rl_multi", "tasks.subset=qwen_1000")
    assert (run.tasks.subset, run.tasks.subsets["qwen_1000"].easy) == ("qwen_1000", 150)
    problems = _problems("+experiment=rl_multi", "tasks.subset=all")
    assert any("published_1000, qwen_1000" in p and "tasks.subset=null" in p for p in problems)


def test_grpo_needs_groups_of_two() -> None:
    problems = _problems("+experiment=rl_multi", "scheduler.group_size=1")
    assert any("scheduler.group_size must be >= 2" in p and "trainer=sft" in p for p in problems)


def test_dynamic_sampling_bounds_refused_below_one() -> None:
    problems = _problems(
        "+experiment=rl_multi", "trainer.dynamic_sampling_max_groups=0", "trainer.dynamic_sampling_patience=0"
    )
    assert any("dynamic_sampling_max_groups must be >= 1" in p for p in problems)
    assert any("dynamic_sampling_patience must be >= 1" in p and "patience=100" in p for p in problems)
    assert (
        load(
            "+experiment=rl_multi", "trainer.dynamic_sampling_patience=null"
        ).trainer.dynamic_sampling_patience
        is None
    )


def _problems(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as err:
        load(*overrides)
    return err.value.problems


def test_truncated_sampling_refused_for_training_with_reason() -> None:
    problems = _problems("+experiment=rl_multi", "sampling.top_p=0.9", "sampling.top_k=20")
    assert len(problems) == 2, "all problems reported at once"
    assert all("importance ratio" in p for p in problems)
    assert any("sampling.top_p=1.0" in p for p in problems)
    assert any("sampling.top_k=-1" in p for p in problems)


def test_eval_sampling_may_truncate() -> None:
    run = load("+experiment=eval", "sampling.top_p=0.9")
    assert run.sampling.top_p == 0.9


def test_errors_name_key_and_fix() -> None:
    problems = _problems(
        "+experiment=rl_multi",
        "scheduler.max_inflight=4",
        "reward.terms.tool_efficiency=0.5",
        "proxy.host=0.0.0.0",
        "proxy.workers=0",
        "trainer.learning_rate=0",
    )
    text = "\n".join(problems)
    assert "proxy.workers=0" in text
    assert "scheduler.max_inflight" in text and "Fix:" in text
    assert "reward.terms.tool_efficiency" in text
    assert "proxy.admin_key" in text
    assert "trainer.learning_rate=3e-6" in text


def test_unknown_reward_term_refused() -> None:
    problems = _problems("+experiment=rl_multi", "+reward.terms.submitted=0.2")
    assert any("submitted" in p and "0.178" in p for p in problems)


def test_engine_devices_without_a_launched_vllm_refused() -> None:
    problems = _problems("+experiment=smoke", "engine.devices=[1]")
    assert any("engine.devices" in p and "engine.devices=[]" in p for p in problems)


def test_tiny_model_on_vllm_serves_its_built_directory() -> None:
    """vLLM loads a tiny model's directory like any checkpoint; the smoke's vLLM form picks
    tiny_agent (heads of 32, which vLLM's CPU attention serves) and the embedded form tiny_qwen."""
    from fineenvs.plan import vllm_args

    run = load("+experiment=smoke", "engine=vllm", "output_dir=/tmp/fineenvs-x")
    args = vllm_args(run)
    assert args.model.endswith("/tiny_agent-s0") and args.served_model_name == "tiny_agent"
    assert args.template_path is None  # model.chat_template=native: the checkpoint's own template
    assert load("+experiment=smoke", "output_dir=/tmp/fineenvs-x").model.name == "tiny_qwen"
    # An explicit model still wins over the smoke's choice.
    assert (
        load("+experiment=smoke", "engine=vllm", "model=tiny_qwen", "output_dir=/tmp/x").model.name
        == "tiny_qwen"
    )


def test_the_cpu_platform_refuses_what_vllms_cpu_build_serves_wrong() -> None:
    from fineenvs.plan import preflight

    for model, why in (
        ("tiny_qwen", "heads of size 16"),
        ("tiny_lfm2", "lfm2 model: on vLLM's CPU build"),
        ("tiny_qwen3_5", "cannot even be imported"),
    ):
        run = load(
            "+experiment=smoke", "engine=vllm", "engine.platform=cpu", f"model={model}", "output_dir=/tmp/x"
        )
        problems = preflight(run)
        assert any(why in p and "engine=transformers" in p for p in problems), (model, problems)
    run = load("+experiment=smoke", "engine=vllm", "engine.platform=cpu", "output_dir=/tmp/x")
    assert not [p for p in preflight(run) if "vLLM's CPU" in p]


def test_cpu_platform_settings_are_checked_at_compose_time() -> None:
    for overrides, message in (
        (("engine.platform=cpu", "engine.weight_sync=nccl"), "broadcasts GPU to GPU"),
        (("engine.cpu_kvcache_gib=0",), "cpu_kvcache_gib must be >= 1"),
        (("engine.parity_tolerance=0",), "parity_tolerance must be > 0"),
        (("engine.weight_sync=http",), "the embedded engine's route"),
    ):
        with pytest.raises(ConfigError, match=message):
            load("+experiment=smoke", "engine=vllm", *overrides, "output_dir=/tmp/x")
    with pytest.raises(ConfigError, match="drives vLLM's routes"):
        load("+experiment=smoke", "engine.weight_sync=file_transfer", "output_dir=/tmp/x")


def test_a_parity_gate_without_a_tolerance_for_the_dtype_is_refused_at_compose_time() -> None:
    with pytest.raises(ConfigError, match="the engine's dtype is 'float8'.*engine.parity_tolerance="):
        load("+experiment=smoke", "engine=vllm", "engine.dtype=float8", "output_dir=/tmp/x")
    # A tolerance given, or no gate: the dtype is the engine's business.
    for extra in ("engine.parity_tolerance=0.5", "engine.parity_gate=false"):
        assert load("+experiment=smoke", "engine=vllm", "engine.dtype=float8", extra, "output_dir=/tmp/x")


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "fineenvs.run",
            *args,
            "hydra.run.dir=" + str(REPO_ROOT / "outputs" / "test-dry"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
    )


def test_cli_dry_run_all_harnesses() -> None:
    res = _run_cli("+experiment=rl_multi", "harness=all", "dry_run=true")
    assert res.returncode == 0, res.stderr
    for name in ALL_HARNESSES:
        assert f"    {name}: " in res.stdout
    assert "vllm serve LiquidAI/LFM2.5-2.6B" in res.stdout
    assert "--logprobs-mode processed_logprobs" in res.stdout
    assert "nothing was started" in res.stdout


def test_cli_dry_run_default_mix_names_exactly_paper_mix() -> None:
    res = _run_cli("+experiment=rl_multi", "dry_run=true")
    assert res.returncode == 0, res.stderr
    listed = {line.split(":")[0].strip() for line in res.stdout.splitlines() if "format=" in line}
    assert listed == PAPER_MIX


def test_cli_bad_override_exit_code_and_message() -> None:
    res = _run_cli("+experiment=rl_multi", "sampling.top_p=0.5", "dry_run=true")
    assert res.returncode == 2
    assert "sampling.top_p" in res.stderr and "Fix:" in res.stderr


def test_cli_multirun_two_jobs(tmp_path: Path) -> None:
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "fineenvs.run",
            "-m",
            "+experiment=rl_multi",
            "harness=opencode,paper_mix",
            "dry_run=true",
            f"hydra.sweep.dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=180,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("fineenvs plan:") == 2
    assert "Launching 2 jobs" in res.stdout + res.stderr


@pytest.mark.parametrize("name", ALL_HARNESSES)
def test_harness_config_uses_the_adapter_format(name: str) -> None:
    """conf/harness/<name>.yaml picks the adapter's default format, and a format the adapter does not
    speak is refused with the ones it does (the adapter is the one copy of package, version, formats)."""
    from fineenvs.harnesses import HARNESSES

    run = load(f"harness={name}")
    spec, adapter = run.harness[name], HARNESSES[name]
    assert spec.api_format.value == adapter.default_format
    assert not any(hasattr(spec, key) for key in ("package", "version", "registry", "api_formats"))
    unspoken = [
        f
        for f in ("openai_chat", "openai_responses", "anthropic_messages", "gemini")
        if f not in adapter.api_formats
    ]
    if unspoken:
        with pytest.raises(ConfigError) as err:
            load(f"harness={name}", f"harness.{name}.api_format={unspoken[0]}")
        assert f"{name} speaks only {', '.join(adapter.api_formats)}" in str(err.value)


def test_greedy_evaluation_composes_but_greedy_training_is_refused() -> None:
    """The trainer's temperature follows sampling's; only a job that trains needs it above 0."""
    run = load("+experiment=eval", "sampling=greedy")
    assert run.sampling.temperature == 0.0 and run.trainer.temperature == 0.0
    with pytest.raises(ConfigError, match=r"trainer.temperature=0.0 must be > 0"):
        load("+experiment=smoke", "sampling=greedy")


def test_plugins_named_by_the_config_are_checked_at_compose_time() -> None:
    """Scripted policies and recipes are found by name (fineenvs/plugins.py); an unknown name, or a
    job=recipe without a recipe, fails composition with the installed names and the fix."""
    problems = _problems("+experiment=collect_teacher", "engine.policy=oracle")
    assert any("engine.policy is 'oracle'" in p and "expert" in p for p in problems), problems
    problems = _problems("+experiment=smoke", "engine.policy=expert")
    assert any("RL would train on tokens the policy did not sample" in p for p in problems), problems
    problems = _problems("+experiment=smoke", "job=recipe")
    assert any("job=recipe runs a recipe, and none is chosen" in p and "mini_repro" in p for p in problems)
    with pytest.raises(ConfigCompositionException, match="recipe"):
        load("+experiment=smoke", "job=recipe", "recipe=no_such_recipe")


def test_a_tiny_model_comes_from_the_model_builder_plugin() -> None:
    """The library reaches the tiny models only through the ``tiny`` entry point, whose object is
    the scaffolding's builder (the serving and training code imports neither)."""
    from fineenvs.models import model_builder
    from fineenvs_recipes.tiny import BUILDER, TINY_MODELS

    builder = model_builder()
    assert builder is BUILDER and builder.names() == sorted(TINY_MODELS)
    assert builder.config("tiny_qwen")["model_type"] == "qwen3"
    run = load("+experiment=smoke", "output_dir=/tmp/fineenvs-x")
    from fineenvs.plan import model_serving_path

    assert model_serving_path(run) == str(builder.path("tiny_qwen", seed=run.model.seed))


def test_a_chat_template_of_another_family_is_refused_at_compose_time() -> None:
    """``dry_run=true`` reports it: before, only building vLLM's command found it."""
    problems = _problems("+experiment=rl_multi", "model.chat_template=qwen_no_thinking")
    assert any(
        "model.chat_template=qwen_no_thinking is a template for qwen3_5, qwen3_8" in p
        and "serves as lfm2_5" in p
        for p in problems
    ), problems
    assert (
        load("+experiment=rl_multi", "model=qwen3_5_2b", "output_dir=/tmp/x").model.chat_template
        == "qwen_no_thinking"
    )


def test_the_dry_run_asks_an_attached_engine_what_it_serves() -> None:
    """``engine.url``: the preflight asks ``GET /v1/models`` as attaching will, so ``dry_run=true``
    shows a server that is down or serves several models (the launcher tests' stand-in engine)."""
    import threading
    from http.server import ThreadingHTTPServer

    from engine_plumbing.fake_server import Handler

    class TwoModels(Handler):
        models = ["a", "b"]

    server = ThreadingHTTPServer(("127.0.0.1", 0), TwoModels)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        run = load("+experiment=eval", f"engine.url={url}/v1", "output_dir=/tmp/fineenvs-x")
        assert any(f"engine.url={url} serves 2 models (a, b)" in p for p in preflight(run))
        TwoModels.models = ["a"]
        assert not any("engine.url" in p for p in preflight(run))
    finally:
        server.shutdown()
        server.server_close()
    assert any(f"engine.url={url}: GET /v1/models failed" in p for p in preflight(run))


def test_the_wire_formats_are_named_once() -> None:
    """``fineenvs.api_formats.ApiFormat`` is the one list of wire formats: the run config's type, the
    dialects' registry and names, and every adapter's formats are its members."""
    from fineenvs import config
    from fineenvs.api_formats import ApiFormat
    from fineenvs.dialects import DIALECTS
    from fineenvs.harnesses import HARNESSES
    from fineenvs.harnesses.base import API_FORMATS

    assert config.ApiFormat is ApiFormat
    assert list(DIALECTS) == [f.value for f in ApiFormat] == list(API_FORMATS)
    assert all(name == dialect.name for name, dialect in DIALECTS.items())
    assert all(set(h.api_formats) <= set(API_FORMATS) for h in HARNESSES.values())


def test_the_dry_run_reports_a_task_selection_that_selects_nothing(tmp_path: Path) -> None:
    """The preflight loads the tasks it can read offline (the generated sets, a local path) with the
    job's own loader, so ``dry_run=true`` shows what the job would otherwise raise when it starts."""
    ok = load("+experiment=smoke", f"output_dir={tmp_path}")
    assert not [p for p in preflight(ok) if "selects no task" in p]
    for job_overrides in (["tasks.limit=0"], ["job=eval", "eval.split=test", "eval.limit=0"]):
        run = load("+experiment=smoke", *job_overrides, f"output_dir={tmp_path}")
        problems = [p for p in preflight(run) if "selects no task" in p]
        assert len(problems) == 1 and "Fix:" in problems[0], (job_overrides, preflight(run))
        with pytest.raises(TaskError, match="selects no task"):
            if run.job is Job.eval:
                select_tasks(replace(run.tasks, limit=run.eval.limit), run.eval.split)
            else:
                select_tasks(run.tasks)
    missing = load("+experiment=smoke", f"tasks.path={tmp_path / 'nowhere'}", f"output_dir={tmp_path}")
    assert [p for p in preflight(missing) if "tasks" in p], preflight(missing)
