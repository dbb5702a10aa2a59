from __future__ import annotations

from pathlib import Path

import pytest

from fineenvs.config import LoggerKind, LoggerSpec, WandbMode
from fineenvs.metrics import MetricLogger, metric_key, read_metrics


def test_metric_keys() -> None:
    assert metric_key("rollout", "pass_rate", "codex") == "rollout/harness/codex/pass_rate"
    assert metric_key("train", "ratio") == "train/ratio"
    with pytest.raises(ValueError, match="unknown metric prefix"):
        metric_key("misc", "x")


def test_jsonl_always_written_and_nan_dropped(tmp_path: Path) -> None:
    spec = LoggerSpec(kind=LoggerKind.none)
    with MetricLogger(spec, tmp_path, run_name="t", config={"a": 1}) as log:
        log.log({"train/loss": 0.5, "train/ratio": float("nan"), "x": None}, step=1)
        log.log({"train/loss": 0.25}, step=2)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["train/loss"] == 0.5 and "train/ratio" not in rows[0] and "x" not in rows[0]


def test_wandb_offline_writes_a_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    spec = LoggerSpec(kind=LoggerKind.wandb, mode=WandbMode.offline, project="fineenvs-test", group="g")
    with MetricLogger(spec, tmp_path, run_name="offline-run", config={"harness": ["codex"]}) as log:
        log.log({"reward/mean": 1.0}, step=0)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs, list((tmp_path / "wandb").iterdir()) if (tmp_path / "wandb").exists() else "no wandb dir"
