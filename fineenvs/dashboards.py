"""The W&B comparison dashboard, built from code: ``python -m fineenvs.dashboards --project P --entity E``.

``dashboard_spec`` describes the dashboard as plain data (sections of line and bar panels over the
metric keys the RL loop and the evaluation log, see ``fineenvs.metrics.metric_key``), so the spec
is testable offline and readable as JSON. ``build_report`` turns it into a W&B Report object
(``wandb-workspaces``) without any network call; only ``--save`` uploads it (``Report.save()``
needs the W&B API and a login).

Runs are compared two ways in every section: grouped by experiment (``config.experiment``, e.g.
rl_multi vs rl_opencode) and grouped by W&B run group (``logger.group``: the sweep, e.g.
sweep_harness_mix, or the experiment's own group).

Panels: reward and pass rate per harness over optimizer steps (``rollout/harness/<h>/reward_mean``,
``.../pass_rate``), ``train/ratio``, tool calls per attempt (``rollout/harness/<h>/tool_calls_mean``),
rows per attempt (``rollout/harness/<h>/rows_per_attempt``), and evaluation: pass@1 over training
steps (in-training hook) and the eval matrix (``eval/harness/<h>/pass_at_1``, latest value per run:
one evaluation run per checkpoint gives the checkpoint x harness matrix).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from fineenvs.jsonl import JsonObject
from fineenvs.metrics import metric_key

PAPER_MIX = ("opencode", "claude_code", "codex", "mini_swe_agent")


def default_harnesses() -> tuple[str, ...]:
    """The paper's mix first, then every other harness fineenvs drives."""
    from fineenvs.harnesses import HARNESSES

    return PAPER_MIX + tuple(sorted(h for h in HARNESSES if h not in PAPER_MIX))


@dataclass(frozen=True)
class Panel:
    kind: str
    """``line`` (metric over steps) or ``bar`` (latest value per run or group)."""
    title: str
    metrics: tuple[str, ...]
    x: str = "Step"


@dataclass(frozen=True)
class Section:
    title: str
    description: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True)
class RunGrouping:
    name: str
    groupby: tuple[str, ...]
    """W&B runset group keys: ``config.<key>`` or ``group`` (the run's group)."""


@dataclass(frozen=True)
class DashboardSpec:
    project: str
    entity: str
    title: str
    description: str
    harnesses: tuple[str, ...]
    groupings: tuple[RunGrouping, ...]
    sections: tuple[Section, ...] = field(default_factory=tuple)

    def metrics(self) -> set[str]:
        return {m for s in self.sections for p in s.panels for m in p.metrics}

    def to_json(self) -> JsonObject:
        return asdict(self)


GROUPINGS = (
    RunGrouping("by experiment", ("config.experiment",)),
    RunGrouping("by sweep / run group", ("group",)),
)


def _per_harness(prefix: str, name: str, harnesses: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(metric_key(prefix, name, h) for h in harnesses)


def dashboard_spec(
    project: str,
    entity: str,
    *,
    harnesses: tuple[str, ...] | None = None,
    title: str = "fineenvs: multi-harness RL comparison",
) -> DashboardSpec:
    """The comparison dashboard for ``entity/project`` over ``harnesses`` (default: all)."""
    if not project or not entity:
        raise ValueError(
            "a W&B dashboard needs both --project and --entity (e.g. --project fineenvs --entity my-team)"
        )
    hs = tuple(harnesses) if harnesses else default_harnesses()
    sections = (
        Section(
            "Reward and pass rate per harness",
            "Mean reward and share of correct attempts per harness, per optimizer step (graded attempts only).",
            (
                Panel("line", "reward per harness", _per_harness("rollout", "reward_mean", hs)),
                Panel("line", "pass rate per harness", _per_harness("rollout", "pass_rate", hs)),
                Panel("line", "reward (all harnesses)", (metric_key("reward", "mean"),)),
            ),
        ),
        Section(
            "Policy fidelity",
            "Importance ratio between the trainer's recomputed policy and the engine's sampling "
            "logprobs (published: 0.9984-0.9999 with full-distribution sampling).",
            (Panel("line", "train/ratio", (metric_key("train", "ratio"),)),),
        ),
        Section(
            "Agent behaviour",
            "Tool calls per attempt (the harness's own count) and training rows per attempt (Claude "
            "Code rewrites its history: ~8 rows per attempt published, other harnesses ~1).",
            (
                Panel("line", "tool calls per attempt", _per_harness("rollout", "tool_calls_mean", hs)),
                Panel("line", "rows per attempt", _per_harness("rollout", "rows_per_attempt", hs)),
            ),
        ),
        Section(
            "Evaluation",
            "pass@1 on the first graded attempt. Over steps: the in-training hook every trainer.eval_steps. "
            "Bars: the latest value per run (an eval job logs one run per checkpoint, so the bars are the "
            "checkpoint x harness matrix).",
            (
                Panel("line", "eval pass@1 over training", (metric_key("eval", "pass_at_1"),)),
                Panel("line", "eval pass@1 per harness over training", _per_harness("eval", "pass_at_1", hs)),
                Panel("bar", "eval matrix: pass@1 per harness", _per_harness("eval", "pass_at_1", hs)),
                Panel("bar", "eval: overall pass@1", (metric_key("eval", "pass_at_1"),)),
                Panel(
                    "bar",
                    "eval: tool-call reduction on co-solved tasks",
                    (metric_key("eval", "tool_call_reduction"),),
                ),
            ),
        ),
    )
    return DashboardSpec(
        project=project,
        entity=entity,
        title=title,
        description="Built by fineenvs.dashboards from code; runs grouped by experiment and by sweep.",
        harnesses=hs,
        groupings=GROUPINGS,
        sections=sections,
    )


def build_report(spec: DashboardSpec) -> Any:
    """The W&B Report object for ``spec``; no network until ``.save()``."""
    try:
        # Typed as Any: the package's own stubs do not re-export its report classes.
        wr: Any = importlib.import_module("wandb_workspaces.reports.v2")
    except ImportError as err:
        raise ImportError(
            "building a W&B Report needs wandb-workspaces: pip install wandb-workspaces==0.4.13 "
            "(the JSON spec, python -m fineenvs.dashboards --json, needs nothing extra)"
        ) from err

    def panel(p: Panel) -> Any:
        if p.kind == "line":
            return wr.LinePlot(title=p.title, x=p.x, y=list(p.metrics))
        if p.kind == "bar":
            return wr.BarPlot(title=p.title, metrics=list(p.metrics))
        raise ValueError(f"unknown panel kind {p.kind!r} in section panel {p.title!r}: use line or bar")

    blocks: list[Any] = [wr.P(spec.description)]
    for section in spec.sections:
        blocks.append(wr.H2(section.title))
        blocks.append(wr.P(section.description))
        runsets = [
            wr.Runset(entity=spec.entity, project=spec.project, name=g.name, groupby=list(g.groupby))
            for g in spec.groupings
        ]
        blocks.append(wr.PanelGrid(runsets=runsets, panels=[panel(p) for p in section.panels]))
    return wr.Report(
        project=spec.project,
        entity=spec.entity,
        title=spec.title,
        description=spec.description,
        blocks=blocks,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fineenvs.dashboards",
        description="Build the W&B comparison dashboard (a Report) from code; upload only with --save.",
    )
    parser.add_argument("--project", required=True)
    parser.add_argument("--entity", required=True)
    parser.add_argument("--harness", default=None, help="comma-separated harnesses (default: every harness)")
    parser.add_argument("--title", default="fineenvs: multi-harness RL comparison")
    parser.add_argument("--json", action="store_true", help="print the spec as JSON")
    parser.add_argument("--save", action="store_true", help="upload the Report to W&B (needs `wandb login`)")
    args = parser.parse_args(argv)
    harnesses = tuple(h.strip() for h in args.harness.split(",") if h.strip()) if args.harness else None
    try:
        spec = dashboard_spec(args.project, args.entity, harnesses=harnesses, title=args.title)
    except ValueError as err:
        print(f"fineenvs dashboards: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(spec.to_json(), indent=2))
    panels = sum(len(s.panels) for s in spec.sections)
    print(
        f"dashboard '{spec.title}' for {spec.entity}/{spec.project}: {len(spec.sections)} sections, "
        f"{panels} panels, {len(spec.metrics())} metric keys, {len(spec.harnesses)} harnesses",
        file=sys.stderr,
    )
    if not args.save:
        print("not saved (add --save to upload it to W&B)", file=sys.stderr)
        return 0
    report = build_report(spec)
    report.save()
    print(f"saved: {report.url}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
