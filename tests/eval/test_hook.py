"""The in-training evaluation hook: reuses a running proxy, evaluates the configured subset, logs
``eval/pass_at_1`` per step, and accumulates every step in ``eval/results.json``; checkpoint
resolution of the eval job refuses bad entries with a clear message."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from hydra import compose, initialize_config_dir

import fineenvs.jobs.eval as ev
from fineenvs.config import RunConfig, to_run_config
from fineenvs.metrics import MetricLogger, read_metrics
from fineenvs.paths import CONF_DIR
from fineenvs.results import append_attempt, read_attempts
from fineenvs.rollout.schedule import PlannedGroup
from fineenvs.rollout.scheduler import AttemptOutcome


def _run(tmp_path: Path, *overrides: str) -> RunConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=["+experiment=smoke", "logger=none", f"output_dir={tmp_path}", *overrides],
        )
    return to_run_config(cfg)


class Solver:
    """Solves a task iff its id is in ``solved``; records the policy version it was called with."""

    def __init__(self, solved: set[str], tools: int) -> None:
        self.solved, self.tools = solved, tools
        self.calls: list[tuple[str, int]] = []
        self.closed = False

    async def __call__(self, group: PlannedGroup, attempt_index: int, policy_version: int) -> AttemptOutcome:
        self.calls.append((group.task_id, policy_version))
        return AttemptOutcome(
            attempt_id=group.attempt_ids[attempt_index],
            group_id=group.group_id,
            task_id=group.task_id,
            harness=group.harness,
            policy_version=policy_version,
            reward=1.0 if group.task_id in self.solved else 0.0,
            tool_calls=self.tools,
            metrics={"answered": 1.0},
        )

    async def aclose(self) -> None:
        self.closed = True


def test_hook_reuses_the_running_proxy_and_accumulates_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _run(tmp_path, "eval.subset_during_training=2")
    runners: list[Solver] = []
    seen: list[dict[str, Any]] = []

    def fake_runner(
        run: RunConfig, tasks: list[Any], *, proxy_url: str, served_model: str, **kw: Any
    ) -> Solver:
        seen.append({"proxy_url": proxy_url, "served": served_model, "tasks": [t.task_id for t in tasks]})
        runners.append(Solver(solved={tasks[0].task_id} if runners else set(), tools=6 if runners else 9))
        return runners[-1]

    def no_engine(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the hook must reuse the running proxy, not start an engine")

    monkeypatch.setattr(ev, "attempt_runner", fake_runner)
    monkeypatch.setattr("fineenvs.jobs.runtime.start_engine", no_engine)
    monkeypatch.setattr("fineenvs.jobs.runtime.start_proxy", no_engine)

    with MetricLogger(run.logger, tmp_path, run_name="t", config={}) as logger:
        m1 = asyncio.run(
            ev.aevaluate_checkpoint(
                run,
                tmp_path / "checkpoints" / "step-1",
                1,
                proxy_url="http://proxy",
                served_model="tiny_qwen",
                logger=logger,
            )
        )
        m2 = ev.evaluate_checkpoint(
            run,
            tmp_path / "checkpoints" / "step-2",
            2,
            proxy_url="http://proxy",
            served_model="tiny_qwen",
            logger=logger,
        )
    assert seen[0] == {"proxy_url": "http://proxy", "served": "tiny_qwen", "tasks": seen[0]["tasks"]}
    assert len(seen[0]["tasks"]) == 2  # eval.subset_during_training
    assert all(r.closed for r in runners)
    assert [v for _, v in runners[1].calls] == [2, 2]  # attempts stamped with the step's policy version
    assert m1["eval/pass_at_1"] == 0.0 and m1["eval/harness/mini_swe_agent/pass_at_1"] == 0.0
    assert m2["eval/pass_at_1"] == 0.5 and m2["eval/harness/mini_swe_agent/pass_at_1"] == 0.5
    logged = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["eval/pass_at_1"]) for r in logged] == [(1, 0.0), (2, 0.5)]

    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert results["checkpoints"] == ["step-1", "step-2"] and results["steps"] == {"step-1": 1, "step-2": 2}
    assert results["pass_at_1"] == {"step-1": {"mini_swe_agent": 0.0}, "step-2": {"mini_swe_agent": 0.5}}
    # Nothing solved at step 1: no co-solved cells, so no reduction figure.
    assert results["tool_call_reduction"] == {}
    assert results["co_solved"]["step-2 vs step-1"]["cells"] == 0


def test_checkpoint_resolution(tmp_path: Path, tiny_qwen_dir: Path) -> None:
    run = _run(tmp_path)
    base = ev.resolve_checkpoints(run)
    assert [k for k, _ in base] == ["tiny_qwen"] and base[0][1] is run
    run.eval.checkpoints = ["base", str(tiny_qwen_dir)]
    resolved = ev.resolve_checkpoints(run)
    assert [k for k, _ in resolved] == ["tiny_qwen", str(tiny_qwen_dir)]
    ckpt_run = resolved[1][1]
    assert ckpt_run.model.source.value == "local" and ckpt_run.model.path == str(tiny_qwen_dir.resolve())
    assert ckpt_run.model.name == run.model.name  # served under the base model's name
    assert ev.served_model_name(run) == "tiny_qwen"

    (tmp_path / "empty").mkdir()
    run.eval.checkpoints = [str(tmp_path / "missing"), str(tmp_path / "empty"), "base", "base"]
    with pytest.raises(ev.EvalError) as err:
        ev.resolve_checkpoints(run)
    text = str(err.value)
    assert "is not a directory" in text and "Hub ids need engine=vllm" in text
    assert "without config.json" in text and "same checkpoint twice" in text


def test_hub_checkpoint_with_revision_for_vllm(tmp_path: Path) -> None:
    run = _run(tmp_path, "model=lfm2_5_2_6b", "engine=vllm")
    run.eval.checkpoints = ["base", "FineEnvs/LFM2.5-2.6B-multiharness-RL@step-700"]
    resolved = ev.resolve_checkpoints(run)
    m = resolved[1][1].model
    assert (m.source.value, m.path, m.revision) == ("hub", "FineEnvs/LFM2.5-2.6B-multiharness-RL", "step-700")
    assert ev.served_model_name(run) == "LiquidAI/LFM2.5-2.6B"  # the checkpoint is served under this name


@pytest.mark.slow
def test_hook_against_a_running_engine(tmp_path: Path) -> None:
    """Real tiny engine started by the caller (as the RL loop has one); the hook puts a proxy in
    front of it, runs mini-swe-agent on one task and leaves the engine running."""
    from contextlib import ExitStack

    import httpx

    from fineenvs.harnesses import check_installed
    from fineenvs.jobs.builders import resolve_model_dir, start_engine

    problems = check_installed(["mini_swe_agent"])
    if problems:
        pytest.fail("the hook test needs its agent CLI: " + "; ".join(problems))
    run = _run(tmp_path, "eval.subset_during_training=1", "scheduler.attempt_timeout_seconds=120")
    with ExitStack() as stack:
        engine = start_engine(run, resolve_model_dir(run), tmp_path, stack)
        metrics = ev.evaluate_checkpoint(run, tmp_path / "unused", 3, engine_url=engine.url)
        assert httpx.get(f"{engine.url}/health", timeout=10).status_code == 200  # still serving
    assert metrics["eval/pass_at_1"] == 0.0 and "eval/harness/mini_swe_agent/pass_at_1" in metrics
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    cell = results["cells"]["step-3"]["mini_swe_agent"]
    assert cell["tasks"] == 1 and cell["attempts"] >= 1
    attempts = read_attempts(tmp_path / "eval" / "attempts.jsonl")
    assert attempts and all(a.step == 3 for a in attempts)
    if cell["graded"]:
        assert cell["prompt_tokens"] > 0 and attempts[0].model_calls >= 1
    assert (tmp_path / "eval" / "step-3" / "proxy.log").exists()


def test_run_eval_orchestration_and_resume(
    tmp_path: Path, tiny_qwen_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """run_eval without engines: each checkpoint served once, results.json after each, the last
    checkpoint's overall pass@1 returned, and a rerun serves nothing."""
    run = _run(tmp_path, "eval.limit=2", f"eval.checkpoints=[base,{tiny_qwen_dir}]")
    served: list[str] = []

    async def fake_serve(run: RunConfig, ckpt_run: RunConfig, *, checkpoint: str, tasks: list[Any], records: Path,
                         prior: list[Any], **_: Any) -> list[Any]:  # fmt: skip
        served.append(checkpoint)
        solver = Solver(solved={tasks[0].task_id} if ckpt_run is not run else set(), tools=4)
        return await ev.run_cells(
            solver, checkpoint=checkpoint, task_ids=[t.task_id for t in tasks], harnesses=list(run.harness),
            prior=prior, infra_retries=1, concurrency=2, sink=lambda a: append_attempt(records, a),
        )  # fmt: skip

    monkeypatch.setattr(ev, "_serve_and_evaluate", fake_serve)
    monkeypatch.setattr(ev, "_check_harnesses", lambda run: None)
    assert ev.run_eval(run) == 0.5
    assert served == ["tiny_qwen", str(tiny_qwen_dir)]
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert results["overall"] == {"tiny_qwen": 0.0, str(tiny_qwen_dir): 0.5}
    assert results["tasks"] == 2 and results["cells"]["tiny_qwen"]["mini_swe_agent"]["attempts"] == 2
    assert "pass@1 on 2 test tasks" in capsys.readouterr().out
    served.clear()
    assert ev.run_eval(run) == 0.5 and served == []  # every cell graded: nothing served again
    assert "already graded" in capsys.readouterr().out


def test_every_checkpoint_gets_the_same_sampling_seed_on_a_cell(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """eval.common_random_numbers (on by default): the runner asks the proxy for a session seed
    from the run's seed, task, harness and try; the same for every checkpoint, unrelated otherwise."""
    run = _run(tmp_path, "eval.limit=2")
    runners: list[Any] = []

    async def keep_runner(runner: Any, **kw: Any) -> list[Any]:
        runners.append(runner)
        return []

    monkeypatch.setattr(ev, "run_cells", keep_runner)
    tasks = ev.eval_tasks(run, 2)
    off = replace(run, eval=replace(run.eval, common_random_numbers=False))
    for r, checkpoint in ((run, "base"), (run, "step-12"), (replace(run, seed=1), "base"), (off, "base")):
        asyncio.run(
            ev._evaluate_served(
                r, checkpoint=checkpoint, out=tmp_path / checkpoint, proxy_url="http://proxy",
                served="tiny_qwen", tasks=tasks, records=tmp_path / "attempts.jsonl", prior=[],
            )
        )  # fmt: skip
    base, step, seed_1, not_common = runners
    a, b = (t.task_id for t in tasks)

    def seed(runner: Any, task: str, harness: str = "pi", attempt: str = "-try0") -> int | None:
        group = PlannedGroup(0, f"t00000-{harness}", 0, 0, task, harness, (f"t00000-{harness}{attempt}",))
        return runner.sampling_seed(group, group.attempt_ids[0])  # type: ignore[no-any-return]

    assert seed(base, a) == seed(step, a) is not None
    others = {seed(base, b), seed(base, a, "opencode"), seed(base, a, attempt="-try1"), seed(seed_1, a)}
    assert seed(base, a) not in others and len(others) == 4
    assert seed(not_common, a) is None

    # The seed travels in the session request; without one the request carries none.
    bodies: list[dict[str, Any]] = []

    def proxy(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(201, json={"session_id": "s1", "key": "k", "base_url": "http://p/s/k"})

    group = PlannedGroup(0, "t00000-pi", 0, 0, a, "pi", ("t00000-pi-try0",))
    for runner in (step, not_common):
        runner.client = httpx.AsyncClient(transport=httpx.MockTransport(proxy), base_url="http://proxy")
        asyncio.run(runner._open_session(group, "t00000-pi-try0", 0))
    assert bodies[0]["sampling_seed"] == seed(base, a) and "sampling_seed" not in bodies[1]
