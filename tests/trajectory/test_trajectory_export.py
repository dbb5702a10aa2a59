"""Export round trips: one session as JSON, many rows as a datasets.Dataset and as Parquet."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from traj_factory import SYSTEM, call, chain, end

from fineenvs.trajectory import (
    SCHEMA_VERSION,
    RowOptions,
    SchemaError,
    build_session,
    dataset_to_rows,
    read_rows_parquet,
    read_session_json,
    rows_to_dataset,
    session_from_json,
    session_to_json,
    write_rows_parquet,
    write_session_json,
)


def session():  # type: ignore[no-untyped-def]
    a = call(0, SYSTEM, [10, 11])
    b1 = call(1, end(a) + [20], [30, 31, 32])
    b2 = call(2, end(a) + [20], [40, 41])
    c = call(3, end(b2) + [21], [50])
    c.harness_ids = {"x-session-affinity": "abc"}
    c.weight_version = 3
    c.metadata = {"model": "tiny", "requested_sampling": {"top_p": 0.9}}
    meta = {"harness": "claude_code", "session_id": "s-1", "task_id": "t", "reward": None}
    return build_session(
        [a, b1, b2, c], meta, RowOptions(drop_discarded=False, shared_prefix="inverse_count")
    )


def test_session_json_round_trip(tmp_path: Path) -> None:
    res = session()
    doc = session_to_json(res)
    assert doc["schema_version"] == SCHEMA_VERSION == 1 and doc["session_id"] == "s-1"
    call_docs = {c["node_id"]: c for c in doc["calls"]}
    # calls are stored as deltas: n3's context is only the tool result after n2's end
    assert call_docs["n3"]["context_ids"] == [21] and call_docs["n3"]["parent_id"] == "n2"
    assert call_docs["n1"]["discarded"] is True
    back = read_session_json(write_session_json(res, tmp_path / "s.json"))
    assert session_to_json(back) == doc
    assert [r.input_ids for r in back.rows.rows] == [r.input_ids for r in res.rows.rows]
    assert back.graph.call("n3") == res.graph.call("n3")
    assert back.metrics == res.metrics and back.findings == res.findings


def test_session_json_refuses_other_versions_and_edited_links() -> None:
    doc = session_to_json(session())
    with pytest.raises(SchemaError, match="schema_version=2"):
        session_from_json({**doc, "schema_version": 2})
    with pytest.raises(SchemaError, match="kind"):
        session_from_json({**doc, "kind": "something"})
    edited = orjson.loads(orjson.dumps(doc))
    n3 = next(c for c in edited["calls"] if c["node_id"] == "n3")
    # claims n3 hangs off n0 directly, yet its tokens continue n2
    n3["parent_id"], n3["context_ids"] = "n0", [20, 40, 41, 21]
    with pytest.raises(SchemaError, match="n3"):
        session_from_json(edited)


def test_fatal_session_exports_its_refusal() -> None:
    doc = session_to_json(build_session(chain(1), {"session_id": "one"}))
    assert doc["trainable"] is False and "degenerate_session" in doc["refusal"]
    assert all(r["trainable"] is False for r in doc["rows"])


def test_rows_dataset_and_parquet_round_trip(tmp_path: Path) -> None:
    rows = session().rows.rows + build_session(chain(3), {"harness": "opencode"}).rows.rows
    assert any(r.loss_weight is None for r in rows) and any(r.loss_weight is not None for r in rows)
    ds = rows_to_dataset(rows)
    assert len(ds) == len(rows) and set(ds["schema_version"]) == {SCHEMA_VERSION}
    assert dataset_to_rows(ds) == rows
    assert read_rows_parquet(write_rows_parquet(rows, tmp_path / "rows.parquet")) == rows
    assert rows_to_dataset([]).num_rows == 0


def test_rows_dataset_refuses_unknown_versions() -> None:
    ds = rows_to_dataset(session().rows.rows)
    ds = ds.map(lambda r: {"schema_version": 9})
    with pytest.raises(SchemaError, match="schema_version=9"):
        dataset_to_rows(ds)
