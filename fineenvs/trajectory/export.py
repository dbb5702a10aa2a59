"""Versioned export: JSON for one session, a ``datasets.Dataset`` / Parquet for many rows.

Schema version 1. A session document holds the calls as deltas against their parent (context
ids + sampled ids, so storage grows with unique tokens), the rows (the record the trainer reads;
never re-tokenized), the row counters, the findings and the fidelity metrics. ``session_from_json``
rebuilds the graph from the calls and checks it links them as recorded. Row datasets carry a
``schema_version`` column; readers refuse versions they do not know instead of guessing.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from fineenvs.jsonl import JsonObject
from fineenvs.trajectory.findings import Finding
from fineenvs.trajectory.graph import TrajectoryGraph
from fineenvs.trajectory.metrics import SessionMetrics
from fineenvs.trajectory.node import CallNode
from fineenvs.trajectory.rows import Row, RowOptions, RowSet
from fineenvs.trajectory.session import SessionResult

if TYPE_CHECKING:
    import datasets

SCHEMA_VERSION = 1
SESSION_KIND = "fineenvs.session"


class SchemaError(ValueError):
    """An exported document does not match the schema this code reads."""


def _check_version(version: object, what: str) -> None:
    if version != SCHEMA_VERSION:
        raise SchemaError(
            f"{what} has schema_version={version!r}, this fineenvs reads schema_version={SCHEMA_VERSION}; "
            "re-export it with a matching fineenvs version (or upgrade fineenvs to read it)"
        )


# ---------------------------------------------------------------------- rows


def row_to_dict(row: Row) -> JsonObject:
    return asdict(row)


def row_from_dict(data: JsonObject) -> Row:
    return Row(
        row_id=data["row_id"],
        input_ids=list(data["input_ids"]),
        loss_mask=list(data["loss_mask"]),
        logprobs=[float(x) for x in data["logprobs"]],
        turn_starts=list(data["turn_starts"]),
        turn_ends=list(data["turn_ends"]),
        node_ids=list(data["node_ids"]),
        role=data["role"],
        trainable=bool(data["trainable"]),
        prompt_len=int(data["prompt_len"]),
        metadata=dict(data.get("metadata") or {}),
        loss_weight=None if data.get("loss_weight") is None else [float(x) for x in data["loss_weight"]],
        cut=bool(data.get("cut", False)),
        weight_version=None if data.get("weight_version") is None else int(data["weight_version"]),
    )


# ---------------------------------------------------------------------- one session (JSON)


def session_to_json(result: SessionResult) -> JsonObject:
    """The session as a JSON-ready dict (see the module docstring)."""
    g = result.graph
    discarded = g.discarded()
    calls = []
    for nid in g.node_ids():
        h = g.header(nid)
        calls.append(
            {
                "node_id": nid,
                "arrival_index": h.arrival_index,
                "parent_id": g.parent(nid),
                "prompt_len": g.prompt_len(nid),
                "context_ids": g.context_ids(nid),
                "sampled_ids": g.sampled_ids(nid),
                "logprobs": h.logprobs,
                "logprobs_aligned": h.logprobs_aligned,
                "constrained": h.constrained,
                "finish_reason": h.finish_reason,
                "has_tools": h.has_tools,
                "weight_version": h.weight_version,
                "harness_ids": h.harness_ids,
                "metadata": h.metadata,
                "discarded": nid in discarded,
            }
        )
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": SESSION_KIND,
        "session_id": result.metadata.get("session_id"),
        "metadata": result.metadata,
        "options": result.rows.options.to_json(),
        "trainable": result.trainable,
        "refusal": result.refusal,
        "calls": calls,
        "rows": [row_to_dict(r) for r in result.rows.rows],
        "counters": result.rows.counters(),
        "findings": [asdict(f) for f in result.findings],
        "metrics": result.metrics.to_dict(),
    }


def session_from_json(data: JsonObject | str | bytes) -> SessionResult:
    """Read a session document back; the graph is rebuilt and checked against the recorded links."""
    doc: JsonObject = orjson.loads(data) if isinstance(data, (str, bytes)) else data
    if doc.get("kind") != SESSION_KIND:
        raise SchemaError(
            f"not a fineenvs session document (kind={doc.get('kind')!r}, expected {SESSION_KIND!r})"
        )
    _check_version(doc.get("schema_version"), "this session document")
    records = {c["node_id"]: c for c in doc["calls"]}
    ends: dict[str, list[int]] = {}

    def end_of(nid: str) -> list[int]:
        # Iterative: chains can be thousands of calls deep.
        chain = []
        cur: str | None = nid
        while cur is not None and cur not in ends:
            chain.append(cur)
            cur = records[cur]["parent_id"]
            if cur is not None and cur not in records:
                raise SchemaError(f"call {chain[-1]!r} names parent {cur!r}, which is not in the document")
        base = ends[cur] if cur is not None else []
        for c in reversed(chain):
            rec = records[c]
            base = base + rec["context_ids"] + rec["sampled_ids"]
            ends[c] = base
        return ends[nid]

    calls = []
    for rec in doc["calls"]:
        end = end_of(rec["node_id"])
        calls.append(
            CallNode(
                node_id=rec["node_id"],
                prompt_ids=end[: rec["prompt_len"]],
                sampled_ids=list(rec["sampled_ids"]),
                logprobs=None if rec["logprobs"] is None else [float(x) for x in rec["logprobs"]],
                finish_reason=rec["finish_reason"],
                has_tools=bool(rec["has_tools"]),
                arrival_index=int(rec["arrival_index"]),
                weight_version=rec["weight_version"],
                harness_ids=dict(rec["harness_ids"]),
                metadata=dict(rec["metadata"]),
                logprobs_aligned=bool(rec["logprobs_aligned"]),
                constrained=bool(rec.get("constrained", False)),  # absent before structured output
            )
        )
    graph = TrajectoryGraph(calls)
    for rec in doc["calls"]:
        if graph.parent(rec["node_id"]) != rec["parent_id"]:
            raise SchemaError(
                f"call {rec['node_id']!r} was recorded under parent {rec['parent_id']!r} but its tokens link it "
                f"to {graph.parent(rec['node_id'])!r}: the document was edited or is corrupt"
            )
    counters = doc.get("counters", {})
    rowset = RowSet(
        rows=[row_from_dict(r) for r in doc["rows"]],
        options=RowOptions(**doc["options"]),
        **{k: v for k, v in counters.items() if k != "n_rows"},
    )
    return SessionResult(
        graph=graph,
        rows=rowset,
        findings=[Finding(**f) for f in doc["findings"]],
        metrics=SessionMetrics.from_dict(doc["metrics"]),
        metadata=dict(doc["metadata"]),
    )


def write_session_json(result: SessionResult, path: str | Path) -> Path:
    path = Path(path)
    path.write_bytes(orjson.dumps(session_to_json(result)))
    return path


def read_session_json(path: str | Path) -> SessionResult:
    return session_from_json(Path(path).read_bytes())


# ---------------------------------------------------------------------- many rows (Dataset / Parquet)


def _features() -> datasets.Features:
    from datasets import Features, List, Value

    return Features(
        {
            "schema_version": Value("int32"),
            "row_id": Value("string"),
            "input_ids": List(Value("int64")),
            "loss_mask": List(Value("int8")),
            "logprobs": List(Value("float64")),
            "loss_weight": List(Value("float64")),
            "turn_starts": List(Value("int64")),
            "turn_ends": List(Value("int64")),
            "node_ids": List(Value("string")),
            "role": Value("string"),
            "trainable": Value("bool"),
            "prompt_len": Value("int64"),
            "cut": Value("bool"),
            "weight_version": Value("int64"),
            "metadata": Value("string"),  # JSON text: metadata differs between harnesses
        }
    )


_OPTIONAL_COLUMNS = {"weight_version"}  # added after schema version 1; older files lack it


def rows_to_dataset(rows: list[Row]) -> datasets.Dataset:
    """Rows as a ``datasets.Dataset`` with a fixed schema (metadata as JSON text)."""
    from datasets import Dataset

    columns: dict[str, list[Any]] = {name: [] for name in _features()}
    for r in rows:
        columns["schema_version"].append(SCHEMA_VERSION)
        columns["row_id"].append(r.row_id)
        columns["input_ids"].append(r.input_ids)
        columns["loss_mask"].append(r.loss_mask)
        columns["logprobs"].append(r.logprobs)
        columns["loss_weight"].append(r.loss_weight)
        columns["turn_starts"].append(r.turn_starts)
        columns["turn_ends"].append(r.turn_ends)
        columns["node_ids"].append(r.node_ids)
        columns["role"].append(r.role)
        columns["trainable"].append(r.trainable)
        columns["prompt_len"].append(r.prompt_len)
        columns["cut"].append(r.cut)
        columns["weight_version"].append(r.weight_version)
        columns["metadata"].append(json.dumps(r.metadata, sort_keys=True))
    return Dataset.from_dict(columns, features=_features())


def dataset_to_rows(ds: datasets.Dataset) -> list[Row]:
    missing = set(_features()) - set(ds.column_names) - _OPTIONAL_COLUMNS
    if missing:
        raise SchemaError(f"row dataset lacks columns {sorted(missing)}; was it written by rows_to_dataset?")
    out = []
    for rec in ds:
        assert isinstance(rec, dict)
        _check_version(rec["schema_version"], f"row {rec['row_id']!r}")
        rec = dict(rec)
        rec["metadata"] = json.loads(rec["metadata"])
        out.append(row_from_dict(rec))
    return out


def write_rows_parquet(rows: list[Row], path: str | Path) -> Path:
    path = Path(path)
    rows_to_dataset(rows).to_parquet(str(path))
    return path


def read_rows_parquet(path: str | Path) -> list[Row]:
    from datasets import Dataset

    ds = Dataset.from_parquet(str(path))
    assert isinstance(ds, Dataset)
    return dataset_to_rows(ds)
