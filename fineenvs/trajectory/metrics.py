"""Capture-fidelity metrics: per session, and aggregated per harness for logs and W&B.

``trainable_token_fraction`` is the share of all sampled tokens of a session that land with mask
1 in at least one exported row: it falls when calls lack logprobs, when retries are discarded,
when rows are dropped as over-long, or when auxiliary rows are left out. A drift break (see
``graph``) is a call that re-rendered an earlier call's output; each one is reported with where
it happened.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from fineenvs.jsonl import JsonObject
from fineenvs.trajectory.graph import DriftBreak, TrajectoryGraph
from fineenvs.trajectory.rows import RowSet


@dataclass
class SessionMetrics:
    harness: str
    n_calls: int
    n_roots: int
    n_leaves: int
    n_forks: int
    n_discarded: int
    n_late_parents: int
    n_rows: int
    n_trainable_rows: int
    sampled_tokens: int
    trainable_tokens: int  # distinct sampled tokens with mask 1 in some row
    prompt_tokens: int
    unique_tokens: int
    held_tokens: int
    drift_breaks: list[DriftBreak] = field(default_factory=list)
    n_constrained: int = 0  # structured-output calls (context only unless rows.train_constrained)

    @property
    def trainable_token_fraction(self) -> float:
        return self.trainable_tokens / self.sampled_tokens if self.sampled_tokens else 0.0

    def to_dict(self) -> JsonObject:
        out = asdict(self)
        out["trainable_token_fraction"] = self.trainable_token_fraction
        return out

    @classmethod
    def from_dict(cls, data: JsonObject) -> SessionMetrics:
        fields = {k: v for k, v in data.items() if k != "trainable_token_fraction"}
        fields["drift_breaks"] = [DriftBreak(**d) for d in data.get("drift_breaks", [])]
        return cls(**fields)


def session_metrics(graph: TrajectoryGraph, rows: RowSet, harness: str = "unknown") -> SessionMetrics:
    stats = graph.stats()
    trained: set[str] = set()
    for row in rows.rows:
        for nid, a, b in zip(row.node_ids, row.turn_starts, row.turn_ends, strict=True):
            if b > a and row.loss_mask[a] == 1:
                trained.add(nid)
    trainable_tokens = sum(graph.end_len(n) - graph.prompt_len(n) for n in trained)
    return SessionMetrics(
        harness=harness,
        n_calls=stats.n_nodes,
        n_roots=stats.n_roots,
        n_leaves=stats.n_leaves,
        n_forks=stats.n_forks,
        n_discarded=stats.n_discarded,
        n_late_parents=stats.n_late_parents,
        n_rows=len(rows.rows),
        n_trainable_rows=sum(1 for r in rows.rows if r.trainable),
        sampled_tokens=stats.sampled_tokens,
        trainable_tokens=trainable_tokens,
        prompt_tokens=stats.prompt_tokens,
        unique_tokens=stats.unique_tokens,
        held_tokens=stats.held_tokens,
        drift_breaks=graph.drift_breaks(),
        n_constrained=sum(1 for n in graph.node_ids() if graph.header(n).constrained),
    )


@dataclass
class HarnessMetrics:
    harness: str
    n_sessions: int = 0
    n_calls: int = 0
    n_rows: int = 0
    n_roots: int = 0
    n_forks: int = 0
    n_discarded: int = 0
    n_drift_breaks: int = 0
    sampled_tokens: int = 0
    trainable_tokens: int = 0
    n_constrained: int = 0

    @property
    def rows_per_attempt(self) -> float:
        return self.n_rows / self.n_sessions if self.n_sessions else 0.0

    @property
    def trainable_token_fraction(self) -> float:
        return self.trainable_tokens / self.sampled_tokens if self.sampled_tokens else 0.0

    @property
    def drift_rate(self) -> float:
        """Drift breaks per model call."""
        return self.n_drift_breaks / self.n_calls if self.n_calls else 0.0

    def log_dict(self, prefix: str = "fidelity") -> dict[str, float]:
        p = f"{prefix}/{self.harness}"
        return {
            f"{p}/sessions": float(self.n_sessions),
            f"{p}/rows_per_attempt": self.rows_per_attempt,
            f"{p}/trainable_token_fraction": self.trainable_token_fraction,
            f"{p}/roots_per_attempt": self.n_roots / self.n_sessions if self.n_sessions else 0.0,
            f"{p}/forks_per_attempt": self.n_forks / self.n_sessions if self.n_sessions else 0.0,
            f"{p}/discarded_per_attempt": self.n_discarded / self.n_sessions if self.n_sessions else 0.0,
            f"{p}/drift_rate": self.drift_rate,
            f"{p}/constrained_calls": float(self.n_constrained),
        }


def aggregate(sessions: list[SessionMetrics]) -> dict[str, HarnessMetrics]:
    """Per-harness totals; ratios are over tokens and calls, not means of per-session ratios."""
    out: dict[str, HarnessMetrics] = {}
    for s in sessions:
        h = out.setdefault(s.harness, HarnessMetrics(harness=s.harness))
        h.n_sessions += 1
        h.n_calls += s.n_calls
        h.n_rows += s.n_rows
        h.n_roots += s.n_roots
        h.n_forks += s.n_forks
        h.n_discarded += s.n_discarded
        h.n_drift_breaks += len(s.drift_breaks)
        h.sampled_tokens += s.sampled_tokens
        h.trainable_tokens += s.trainable_tokens
        h.n_constrained += s.n_constrained
    return out
