"""The W&B dashboard spec builds offline, names the metric keys the RL loop and the evaluation really
log, and becomes a wandb-workspaces Report without a network call."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fineenvs.dashboards import PAPER_MIX, build_report, dashboard_spec, default_harnesses, main
from fineenvs.jobs.rl import group_metrics
from fineenvs.results import EvalAttempt, compute_results, eval_metrics
from fineenvs.rollout.schedule import PlannedGroup
from fineenvs.rollout.scheduler import AttemptOutcome, GroupOutcome

HS = ("opencode", "codex")


def _panels(spec: Any) -> dict[str, tuple[str, tuple[str, ...]]]:
    return {p.title: (p.kind, p.metrics) for s in spec.sections for p in s.panels}


def test_spec_panels_and_metric_keys() -> None:
    spec = dashboard_spec("proj", "team", harnesses=HS)
    panels = _panels(spec)
    assert panels["reward per harness"] == (
        "line",
        ("rollout/harness/opencode/reward_mean", "rollout/harness/codex/reward_mean"),
    )
    assert panels["pass rate per harness"][1] == (
        "rollout/harness/opencode/pass_rate",
        "rollout/harness/codex/pass_rate",
    )
    assert panels["train/ratio"] == ("line", ("train/ratio",))
    assert panels["tool calls per attempt"][1] == (
        "rollout/harness/opencode/tool_calls_mean",
        "rollout/harness/codex/tool_calls_mean",
    )
    assert panels["rows per attempt"][1] == (
        "rollout/harness/opencode/rows_per_attempt",
        "rollout/harness/codex/rows_per_attempt",
    )
    assert panels["eval matrix: pass@1 per harness"] == (
        "bar",
        ("eval/harness/opencode/pass_at_1", "eval/harness/codex/pass_at_1"),
    )
    assert ("config.experiment",) in [g.groupby for g in spec.groupings]
    assert ("group",) in [g.groupby for g in spec.groupings]
    as_json = json.loads(json.dumps(spec.to_json()))
    assert as_json["sections"][0]["panels"][0]["metrics"][0] == "rollout/harness/opencode/reward_mean"


def test_default_harnesses_start_with_the_paper_mix() -> None:
    hs = default_harnesses()
    assert hs[:4] == PAPER_MIX and len(set(hs)) == len(hs) and "claude_code" in hs and len(hs) >= 10


def test_spec_keys_are_what_the_rl_loop_and_eval_log() -> None:
    spec = dashboard_spec("proj", "team", harnesses=HS)
    attempts = []
    for i, h in enumerate(HS):
        planned = PlannedGroup(i, f"g{i}", 0, i, f"t{i}", h, (f"g{i}-a0", f"g{i}-a1"))
        outcomes = [
            AttemptOutcome(
                f"g{i}-a{j}", f"g{i}", f"t{i}", h, 0, reward=float(j), tool_calls=3, rows=[object()]
            )
            for j in range(2)
        ]
        attempts.append(GroupOutcome(planned, outcomes))
    logged = set(group_metrics(attempts)) | {"train/ratio"}
    evals = [EvalAttempt("base", "t", h, 0, f"a-{h}", reward=1.0, tool_calls=2) for h in HS] + [
        EvalAttempt("rl", "t", h, 0, f"b-{h}", reward=1.0, tool_calls=1) for h in HS
    ]
    results = compute_results(
        evals, checkpoints=["base", "rl"], harnesses=list(HS), task_ids=["t"], split="test"
    )
    logged |= set(eval_metrics(results, "rl"))
    missing = spec.metrics() - logged
    assert not missing, f"dashboard panels on keys nobody logs: {sorted(missing)}"


def test_report_builds_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    wandb = pytest.importorskip("wandb")
    wr = pytest.importorskip("wandb_workspaces.reports.v2")

    def no_network(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("building the report must not touch the W&B API")

    monkeypatch.setattr(wandb, "Api", no_network)
    spec = dashboard_spec("proj", "team", harnesses=HS)
    report = build_report(spec)
    assert isinstance(report, wr.Report) and report.project == "proj" and report.entity == "team"
    grids = [b for b in report.blocks if isinstance(b, wr.PanelGrid)]
    assert len(grids) == len(spec.sections)
    lines = {p.title: tuple(p.y) for g in grids for p in g.panels if isinstance(p, wr.LinePlot)}
    bars = {p.title: tuple(p.metrics) for g in grids for p in g.panels if isinstance(p, wr.BarPlot)}
    assert lines["reward per harness"] == (
        "rollout/harness/opencode/reward_mean",
        "rollout/harness/codex/reward_mean",
    )
    assert lines["train/ratio"] == ("train/ratio",)
    assert bars["eval matrix: pass@1 per harness"] == (
        "eval/harness/opencode/pass_at_1",
        "eval/harness/codex/pass_at_1",
    )
    for g in grids:
        assert [tuple(r.groupby) for r in g.runsets] == [("config.experiment",), ("group",)]
        assert all(r.entity == "team" and r.project == "proj" for r in g.runsets)


def test_cli_without_save_uploads_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--project", "p", "--entity", "e", "--harness", "codex", "--json"]) == 0
    out, err = capsys.readouterr()
    spec = json.loads(out)
    assert spec["harnesses"] == ["codex"] and "not saved" in err
    assert main(["--project", "", "--entity", "e"]) == 2
