"""The job runtime: harness check -> engine -> probe -> proxy -> runners, torn down in reverse."""

from __future__ import annotations

import asyncio
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hydra import compose, initialize_config_dir

import fineenvs.jobs.runtime as rt_mod
from fineenvs.config import RunConfig, to_run_config
from fineenvs.jobs.errors import RunAborted
from fineenvs.jobs.runtime import Probe, job_runtime
from fineenvs.paths import CONF_DIR
from fineenvs.rollout.attempt import ProxyAttemptRunner
from fineenvs.trajectory import RowOptions


def _run(tmp_path: Path) -> RunConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["+experiment=smoke", f"output_dir={tmp_path}"])
    return to_run_config(cfg)


def _fakes(monkeypatch: pytest.MonkeyPatch, events: list[str], *, grade: str = "tokens") -> None:
    def start_engine(run: Any, model_dir: Path, out: Path, stack: ExitStack, **kw: Any) -> Any:
        events.append(f"engine up {model_dir.name}")
        stack.callback(events.append, "engine down")
        return SimpleNamespace(url="http://engine", kind="fake", served_model_name="m", weight_sync=None)

    def start_proxy(run: Any, engine: Any, out: Path, stack: ExitStack) -> str:
        events.append("proxy up")
        stack.callback(events.append, "proxy down")
        return "http://proxy"

    def probe_engine(url: str, model: str) -> Any:
        events.append("probe")
        return SimpleNamespace(grade=SimpleNamespace(value=grade))

    def require_training_grade(report: Any) -> None:
        if report.grade.value != "tokens":
            raise RuntimeError("engine is not training grade")

    monkeypatch.setattr(rt_mod, "start_engine", start_engine)
    monkeypatch.setattr(rt_mod, "start_proxy", start_proxy)
    monkeypatch.setattr(
        rt_mod, "check_harnesses", lambda run, error=RunAborted: events.append("harnesses ok")
    )
    monkeypatch.setattr("fineenvs.engine.probe_engine", probe_engine)
    monkeypatch.setattr("fineenvs.engine.require_training_grade", require_training_grade)


def test_setup_in_order_and_teardown_in_reverse_also_on_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    _fakes(monkeypatch, events)
    run = _run(tmp_path)
    real_close = ProxyAttemptRunner.aclose

    async def aclose(self: ProxyAttemptRunner) -> None:
        events.append("runner closed")
        await real_close(self)

    monkeypatch.setattr(ProxyAttemptRunner, "aclose", aclose)

    async def job() -> None:
        async with job_runtime(run, tmp_path, model_dir=tmp_path / "model", probe=Probe.require) as rt:
            runner = rt.attempt_runner([], attempts_dir=tmp_path / "attempts", row_options=RowOptions())
            assert runner.settings.proxy_url == "http://proxy" and runner.settings.served_model == "m"
            events.append("job")
            raise KeyboardInterrupt  # what SIGTERM becomes (fineenvs.lifecycle)

    with pytest.raises(KeyboardInterrupt):
        asyncio.run(job())
    assert events == [
        "harnesses ok", "engine up model", "probe", "proxy up", "job",
        "runner closed", "proxy down", "engine down",
    ]  # fmt: skip


def test_a_training_job_stops_before_the_proxy_when_the_engine_is_not_training_grade(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    _fakes(monkeypatch, events, grade="text")
    run = _run(tmp_path)

    async def job(probe: Probe) -> None:
        async with job_runtime(run, tmp_path, model_dir=tmp_path / "m", probe=probe, check=False):
            events.append("job")

    with pytest.raises(RuntimeError, match="not training grade"):
        asyncio.run(job(Probe.require))
    assert events == ["engine up m", "probe", "engine down"]
    events.clear()
    asyncio.run(job(Probe.inform))  # teacher collection: any grade will do
    assert events == ["engine up m", "probe", "proxy up", "job", "proxy down", "engine down"]
