"""A session recorded through the real capture proxy in front of the embedded engine (tiny Qwen).

Three chat turns plus one retry (the same request sent twice), exactly as an agent would send
them, then the proxy's recorded calls go through the trajectory package. Slow tier: it loads a
tiny model and generates on CPU.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from traj_factory import proxy_calls_to_nodes

from fineenvs.trajectory import (
    RowOptions,
    build_session,
    read_rows_parquet,
    session_from_json,
    session_to_json,
    write_rows_parquet,
)

pytestmark = pytest.mark.slow


def record_session(model_dir: Path, store_dir: Path) -> dict[str, Any]:
    from fineenvs.engine.server import create_engine_app, serve_in_thread
    from fineenvs.proxy.app import create_proxy_app
    from fineenvs.proxy.settings import ProxySettings
    from fineenvs.proxy.store import CallStore

    engine = create_engine_app(model_dir, served_model_name="tiny_qwen", seed=0)
    with serve_in_thread(engine) as url:
        settings = ProxySettings(upstream_url=url, served_model="tiny_qwen", store_dir=store_dir, fsync=False)
        store = CallStore(store_dir, fsync=False)
        app = create_proxy_app(settings, store=store)

        async def drive() -> dict[str, Any]:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://proxy.test", timeout=120) as c:
                r = await c.post("/sessions", json={"harness": "scripted", "task": "t"})
                assert r.status_code == 201, r.text
                s = r.json()
                messages: list[dict[str, Any]] = [
                    {"role": "system", "content": "You are a terse assistant."},
                    {"role": "user", "content": "Count to three."},
                ]
                for turn in range(3):
                    body = {"model": "m", "messages": messages, "max_tokens": 12}
                    r = await c.post(f"/s/{s['key']}/v1/chat/completions", json=body)
                    assert r.status_code == 200, r.text
                    if turn == 1:  # the agent re-sends the same request and uses the second answer
                        r = await c.post(f"/s/{s['key']}/v1/chat/completions", json=body)
                        assert r.status_code == 200, r.text
                    reply = r.json()["choices"][0]["message"]
                    messages = [*messages, reply, {"role": "user", "content": f"Go on ({turn})."}]
                rollout = await c.get(f"/sessions/{s['session_id']}/rollout")
                assert rollout.status_code == 200, rollout.text
                return dict(rollout.json())

        try:
            return asyncio.run(drive())
        finally:
            store.close()


def test_session_recorded_through_the_proxy_builds_and_round_trips(
    tiny_qwen_dir: Path, tmp_path: Path
) -> None:
    rollout = record_session(tiny_qwen_dir, tmp_path / "store")
    calls = rollout["calls"]
    assert len(calls) == 4
    nodes = proxy_calls_to_nodes(calls)
    res = build_session(nodes, {"harness": "scripted"}, RowOptions(drop_discarded=False))
    g = res.graph
    first, retried, used, last = (c["call_id"] for c in calls)
    # The retry (same request, answer not used) is discarded; the answer the agent used continues.
    assert g.discarded() == {retried}
    assert g.parent(retried) == g.parent(used)
    # Every later call either extends an earlier one or is reported as a drift break (the chat
    # template re-rendered the model's text differently from the ids it sampled).
    drifted = {d.node_id for d in g.drift_breaks()}
    for nid in (used, last):
        assert g.parent(nid) is not None or nid in drifted
    by_id = {n.node_id: n for n in nodes}
    for row in res.rows.rows:
        assert len(row.input_ids) == len(row.loss_mask) == len(row.logprobs)
        assert row.input_ids == by_id[row.node_ids[-1]].prompt_ids + by_id[row.node_ids[-1]].sampled_ids
        for nid, a, b in zip(row.node_ids, row.turn_starts, row.turn_ends, strict=True):
            assert row.input_ids[a:b] == by_id[nid].sampled_ids
            if row.loss_mask[a] == 1:
                assert row.logprobs[a:b] == by_id[nid].logprobs and all(lp <= 0.0 for lp in row.logprobs[a:b])
    assert res.metrics.trainable_token_fraction == 1.0
    # The trajectory the proxy itself serves is our session document; it reads back unchanged.
    doc = rollout["trajectory"]
    assert session_to_json(session_from_json(orjson.dumps(doc))) == orjson.loads(orjson.dumps(doc))
    mine = session_to_json(res)
    assert session_to_json(session_from_json(orjson.dumps(mine))) == mine
    assert read_rows_parquet(write_rows_parquet(res.rows.rows, tmp_path / "rows.parquet")) == res.rows.rows
