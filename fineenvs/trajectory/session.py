"""One session end to end: calls -> graph -> rows -> findings -> metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from fineenvs.jsonl import JsonObject
from fineenvs.trajectory.findings import Finding, is_fatal, refusal, validate
from fineenvs.trajectory.graph import TrajectoryGraph
from fineenvs.trajectory.metrics import SessionMetrics, session_metrics
from fineenvs.trajectory.node import CallNode
from fineenvs.trajectory.rows import Row, RowOptions, RowSet, build_rows


@dataclass
class SessionResult:
    graph: TrajectoryGraph
    rows: RowSet
    findings: list[Finding]
    metrics: SessionMetrics
    metadata: JsonObject = field(default_factory=dict)

    @property
    def trainable(self) -> bool:
        return not is_fatal(self.findings)

    @property
    def refusal(self) -> str | None:
        """Why this session exports no training rows (its fatal findings), or None."""
        return refusal(self.findings)

    def training_rows(self) -> list[Row]:
        """Rows a trainer may use: none when a finding is fatal, else the trainable ones."""
        if not self.trainable:
            return []
        return [r for r in self.rows.rows if r.trainable]


def build_session(
    nodes: list[CallNode],
    metadata: JsonObject | None = None,
    options: RowOptions | None = None,
    *,
    min_calls: int = 2,
) -> SessionResult:
    """Build everything for one session. Pure: no I/O; deterministic in the set of calls.

    ``metadata`` (task id, harness, reward, ...) is attached to every row; ``metadata["harness"]``
    names the harness in the fidelity metrics. ``min_calls`` is the fewest model calls an
    agentic session may have before it counts as degenerate (1 turns the check off).
    """
    metadata = dict(metadata or {})
    options = options or RowOptions()
    graph = TrajectoryGraph(nodes)
    rows = build_rows(graph, options, metadata)
    findings = validate(graph, rows, min_calls=min_calls)
    if is_fatal(findings):
        for row in rows.rows:
            row.trainable = False
    metrics = session_metrics(graph, rows, harness=str(metadata.get("harness", "unknown")))
    return SessionResult(graph=graph, rows=rows, findings=findings, metrics=metrics, metadata=metadata)
