"""Metric logging: W&B (online/offline) or nothing, plus a local ``metrics.jsonl`` always.

Metric keys are slash-namespaced by subsystem (``rollout/``, ``reward/``, ``train/``, ``proxy/``,
``eval/``); ``metric_key`` builds per-harness keys in one place so dashboards and the local report
read the same names. The JSONL file is what ``python -m fineenvs.report`` plots when W&B is off.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

from fineenvs.config import LoggerKind, LoggerSpec
from fineenvs.jsonl import JsonObject

PREFIXES = ("rollout", "reward", "train", "proxy", "eval", "fidelity", "time")


def metric_key(prefix: str, name: str, harness: str | None = None) -> str:
    """``rollout/harness/<h>/<name>`` or ``<prefix>/<name>``."""
    if prefix not in PREFIXES:
        raise ValueError(f"unknown metric prefix {prefix!r}; known: {', '.join(PREFIXES)}")
    return f"{prefix}/harness/{harness}/{name}" if harness else f"{prefix}/{name}"


def _plain(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return {k: _plain(v) for k, v in asdict(value).items()}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "value") and not isinstance(value, (int, float, str, bool)):
        return value.value
    return value


class MetricLogger:
    def __init__(self, spec: LoggerSpec, output_dir: Path, *, run_name: str, config: Any) -> None:
        self.spec = spec
        output_dir.mkdir(parents=True, exist_ok=True)
        self.path = output_dir / "metrics.jsonl"
        self._file = self.path.open("a", encoding="utf-8")
        self._wandb: Any = None
        if spec.kind is LoggerKind.wandb and spec.mode.value != "disabled":
            import wandb

            self._wandb = wandb.init(
                project=spec.project,
                entity=spec.entity,
                group=spec.group,
                tags=list(spec.tags),
                name=run_name,
                mode=spec.mode.value,
                dir=str(output_dir),
                config=_plain(config),
                reinit="finish_previous",
            )

    def log(self, metrics: Mapping[str, float | int | None], step: int) -> None:
        clean = {
            k: v for k, v in metrics.items() if v is not None and not (isinstance(v, float) and math.isnan(v))
        }
        self._file.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log(clean, step=step)

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: Path) -> list[JsonObject]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_summary(out: Path, title: str, summary: JsonObject) -> None:
    """``summary.json`` in the run directory, and the same lines on stdout."""
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\n{title}")
    for key, value in summary.items():
        print(f"  {key}: {value}")
