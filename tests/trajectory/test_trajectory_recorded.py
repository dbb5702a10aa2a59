"""Sessions recorded through the real capture proxy (embedded engine, tiny model).

Hook for the proxy work: drop recorded sessions into ``tests/trajectory/recorded/*.json`` (or
point ``FINEENVS_RECORDED_SESSIONS`` at a folder), one file per session: either the proxy's
``GET /sessions/{id}/rollout`` body (calls with ``call_id``) or
``{"metadata": {...}, "calls": [CallNode.to_dict(), ...]}``. Every file is then built, checked
for aligned rows and round-tripped through the JSON and Parquet exports. ``test_trajectory_proxy_engine``
records a live session the same way in the slow tier; this hook is for sessions recorded by real
harnesses. Without files it is skipped, saying so.
"""

from __future__ import annotations

import os
from pathlib import Path

import orjson
import pytest
from traj_factory import proxy_calls_to_nodes

from fineenvs.trajectory import (
    CallNode,
    build_session,
    read_rows_parquet,
    session_from_json,
    session_to_json,
    write_rows_parquet,
)

HERE = Path(__file__).parent / "recorded"


def recorded_sessions() -> list[Path]:
    folder = Path(os.environ.get("FINEENVS_RECORDED_SESSIONS", HERE))
    return sorted(folder.glob("*.json")) if folder.is_dir() else []


@pytest.mark.parametrize("path", recorded_sessions() or [None], ids=lambda p: p.name if p else "none")
def test_recorded_proxy_session_builds_and_round_trips(path: Path | None, tmp_path: Path) -> None:
    if path is None:
        pytest.skip(
            "no recorded proxy sessions yet: record one with the proxy and the embedded engine into "
            f"{HERE} (format in this module's docstring)"
        )
    doc = orjson.loads(path.read_bytes())
    raw = doc["calls"]
    calls = proxy_calls_to_nodes(raw) if raw and "call_id" in raw[0] else [CallNode.from_dict(c) for c in raw]
    res = build_session(calls, doc.get("metadata", {}), min_calls=1)
    assert not any(f.code in {"no_prompt_ids", "positive_logprob"} for f in res.findings), res.findings
    for row in res.rows.rows:
        assert len(row.input_ids) == len(row.loss_mask) == len(row.logprobs)
        assert all(lp <= 0.0 for lp in row.logprobs)
    assert session_to_json(session_from_json(orjson.dumps(session_to_json(res)))) == session_to_json(res)
    assert read_rows_parquet(write_rows_parquet(res.rows.rows, tmp_path / "r.parquet")) == res.rows.rows
