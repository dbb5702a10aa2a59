"""Sessions recorded through the real capture proxy (embedded engine, tiny model).

Hook for the proxy work: drop recorded sessions into ``tests/trajectory/recorded/*.json`` (or
point ``FINEENVS_RECORDED_SESSIONS`` at a folder), one file per session: either the proxy's
``GET /sessions/{id}/rollout`` body (calls with ``call_id``) or
``{"metadata": {...}, "calls": [CallNode.to_dict(), ...]}``. Every file is then built, checked
for aligned rows and round-tripped through the JSON and Parquet exports. ``test_trajectory_proxy_engine``
records a live session the same way in the slow tier; this hook is for sessions recorded by real
harnesses (written by ``python -m tests.harnesses.record_sessions``: Claude Code, Codex,
OpenCode and Mini-SWE-Agent against the scripted engine). Without files it is skipped, saying so.
"""

from __future__ import annotations

import os
from pathlib import Path

import orjson
import pytest
from traj_factory import proxy_calls_to_nodes

from fineenvs.trajectory import (
    CallNode,
    RowOptions,
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
    # Budget large enough for a whole Claude Code prompt in the tiny tokenizer (~44k tokens).
    res = build_session(calls, doc.get("metadata", {}), RowOptions(max_tokens=131072), min_calls=1)
    assert not any(f.code in {"no_prompt_ids", "positive_logprob"} for f in res.findings), res.findings
    for row in res.rows.rows:
        assert len(row.input_ids) == len(row.loss_mask) == len(row.logprobs)
        assert all(lp <= 0.0 for lp in row.logprobs)
    assert session_to_json(session_from_json(orjson.dumps(session_to_json(res)))) == session_to_json(res)
    assert read_rows_parquet(write_rows_parquet(res.rows.rows, tmp_path / "r.parquet")) == res.rows.rows


@pytest.mark.parametrize("path", recorded_sessions() or [None], ids=lambda p: p.name if p else "none")
def test_recorded_agent_turns_chain_into_one_row(path: Path | None) -> None:
    """A harness that sends its history back unchanged yields one agent row holding every agent
    turn (the engine rendered the assistant turn exactly as it was sampled)."""
    if path is None:
        pytest.skip(f"no recorded proxy sessions in {HERE}")
    doc = orjson.loads(path.read_bytes())
    calls = proxy_calls_to_nodes(doc["calls"])
    res = build_session(calls, doc.get("metadata", {}), RowOptions(max_tokens=131072))
    agent_calls = [c for c in calls if c.has_tools]
    agent_rows = [r for r in res.rows.rows if r.role == "agent"]
    assert len(agent_rows) == 1, [r.node_ids for r in agent_rows]
    assert agent_rows[0].node_ids == [c.node_id for c in agent_calls]
    assert sum(agent_rows[0].loss_mask) == sum(len(c.sampled_ids) for c in agent_calls)
    assert res.graph.stats().n_drift_breaks == 0
