"""Call nodes -> longest-common-token-prefix graph -> training rows (pure data, deterministic).

See ``graph`` for the linking, retry and drift rules, ``rows`` for masks, the shared-prefix
policies and the over-long rule, ``findings`` for validation, ``metrics`` for capture fidelity,
``export`` for the versioned file formats and ``record`` for the proxy's call record (the typed
input of all of it) and its conversion into nodes.
"""

from fineenvs.trajectory.export import (
    SCHEMA_VERSION,
    SchemaError,
    dataset_to_rows,
    read_rows_parquet,
    read_session_json,
    rows_to_dataset,
    session_from_json,
    session_to_json,
    write_rows_parquet,
    write_session_json,
)
from fineenvs.trajectory.findings import Finding, is_fatal, refusal, validate
from fineenvs.trajectory.graph import DriftBreak, GraphStats, TrajectoryGraph
from fineenvs.trajectory.metrics import HarnessMetrics, SessionMetrics, aggregate, session_metrics
from fineenvs.trajectory.node import CallNode, logprob_problem
from fineenvs.trajectory.record import CallRecord, SessionLog, calls_to_nodes
from fineenvs.trajectory.rows import Row, RowOptions, RowSet, build_rows
from fineenvs.trajectory.session import SessionResult, build_session

__all__ = [
    "SCHEMA_VERSION",
    "CallNode",
    "CallRecord",
    "DriftBreak",
    "Finding",
    "GraphStats",
    "HarnessMetrics",
    "Row",
    "RowOptions",
    "RowSet",
    "SchemaError",
    "SessionLog",
    "SessionMetrics",
    "SessionResult",
    "TrajectoryGraph",
    "aggregate",
    "build_rows",
    "build_session",
    "calls_to_nodes",
    "dataset_to_rows",
    "is_fatal",
    "logprob_problem",
    "read_rows_parquet",
    "read_session_json",
    "refusal",
    "rows_to_dataset",
    "session_from_json",
    "session_metrics",
    "session_to_json",
    "validate",
    "write_rows_parquet",
    "write_session_json",
]
