"""Property tests on random sessions over a tiny alphabet (so accidental prefixes are common)."""

from __future__ import annotations

import random
from dataclasses import asdict

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from traj_factory import end

from benchmarks.tree import all_pairs_parents
from fineenvs.trajectory import (
    CallNode,
    RowOptions,
    TrajectoryGraph,
    build_rows,
    build_session,
    logprob_problem,
    session_from_json,
    session_to_json,
)

TOK = st.integers(0, 3)


@st.composite
def sessions(draw: st.DrawFn) -> list[CallNode]:
    nodes: list[CallNode] = []
    for i in range(draw(st.integers(1, 10))):
        kind = draw(st.sampled_from(["root", "extend", "extend", "retry", "drift"]))
        if not nodes or kind == "root":
            prompt = draw(st.lists(TOK, min_size=1, max_size=5))
        else:
            base = draw(st.sampled_from(nodes))
            if kind == "extend":
                prompt = end(base) + draw(st.lists(TOK, max_size=3))
            elif kind == "retry":
                prompt = list(base.prompt_ids)
            else:
                cut = draw(st.integers(1, len(end(base))))
                prompt = end(base)[:cut] + draw(st.lists(TOK, min_size=1, max_size=3))
        sampled = draw(st.lists(TOK, max_size=4))
        lp_kind = draw(st.sampled_from(["ok", "ok", "ok", "none", "short"]))
        logprobs = {
            "ok": [-0.5 - 0.1 * k for k in range(len(sampled))],
            "none": None,
            "short": [-0.5] * max(0, len(sampled) - 1),
        }[lp_kind]
        nodes.append(
            CallNode(
                node_id=f"n{i}",
                prompt_ids=prompt,
                sampled_ids=sampled,
                logprobs=logprobs,
                finish_reason="stop",
                has_tools=draw(st.booleans()),
                arrival_index=draw(st.integers(0, 4)),  # duplicates: node id breaks ties
            )
        )
    return nodes


def snapshot(g: TrajectoryGraph) -> dict[str, object]:
    return {
        "parents": {n: g.parent(n) for n in g.node_ids()},
        "discarded": g.discarded(),
        "drift": g.drift_breaks(),
        "late": g.late_parents(),
        "rows": [asdict(r) for r in build_rows(g, RowOptions(drop_discarded=False)).rows],
    }


SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(sessions())
def test_parents_match_the_all_pairs_reference(nodes: list[CallNode]) -> None:
    g = TrajectoryGraph(nodes)
    ref = all_pairs_parents(nodes)
    assert {n.node_id: g.parent(n.node_id) for n in nodes} == ref
    for n in nodes:
        assert g.call(n.node_id) == n


@SETTINGS
@given(sessions(), st.randoms(use_true_random=False))
def test_graph_is_independent_of_arrival_order(nodes: list[CallNode], rnd: random.Random) -> None:
    shuffled = list(nodes)
    rnd.shuffle(shuffled)
    assert snapshot(TrajectoryGraph(nodes)) == snapshot(TrajectoryGraph(shuffled))


@SETTINGS
@given(sessions())
def test_rows_are_aligned_and_cover_every_live_sampled_token(nodes: list[CallNode]) -> None:
    by_id = {n.node_id: n for n in nodes}
    g = TrajectoryGraph(nodes)
    rows = build_rows(g, RowOptions(max_tokens=10**6)).rows
    covered: set[str] = set()
    for r in rows:
        n = len(r.input_ids)
        assert len(r.loss_mask) == len(r.logprobs) == n
        assert all(lp == 0.0 for lp, m in zip(r.logprobs, r.loss_mask, strict=True) if m == 0)
        assert r.input_ids == end(by_id[r.node_ids[-1]])
        for nid, a, b in zip(r.node_ids, r.turn_starts, r.turn_ends, strict=True):
            node = by_id[nid]
            assert r.input_ids[a:b] == node.sampled_ids
            if any(r.loss_mask[a:b]):
                assert r.loss_mask[a:b] == [1] * (b - a) and r.logprobs[a:b] == node.logprobs
                covered.add(nid)
    # every sampled token of every non-discarded call with usable logprobs is trained somewhere
    live = {n.node_id for n in nodes if n.node_id not in g.discarded() and logprob_problem(n) is None}
    assert live <= covered


@SETTINGS
@given(sessions())
def test_shared_prefix_policies_count_each_token_as_documented(nodes: list[CallNode]) -> None:
    g = TrajectoryGraph(nodes)
    per_row = build_rows(g, RowOptions(shared_prefix="per_row")).rows
    once = build_rows(g, RowOptions(shared_prefix="once")).rows
    inv = build_rows(g, RowOptions(shared_prefix="inverse_count")).rows

    def trained(rows: list, weights: bool = False) -> dict[str, float]:  # type: ignore[type-arg]
        out: dict[str, float] = {}
        for r in rows:
            for nid, a, b in zip(r.node_ids, r.turn_starts, r.turn_ends, strict=True):
                if b > a and r.loss_mask[a]:
                    w = r.loss_weight[a] if weights else 1.0
                    out[nid] = out.get(nid, 0.0) + w
        return out

    counts = trained(per_row)
    assert set(trained(once)) == set(counts) and all(v == 1.0 for v in trained(once).values())
    assert {k: round(v, 9) for k, v in trained(inv, weights=True).items()} == {k: 1.0 for k in counts}
    for r in inv:
        assert r.loss_weight is not None and len(r.loss_weight) == len(r.input_ids)
        assert all(w == 0.0 for w, m in zip(r.loss_weight, r.loss_mask, strict=True) if m == 0)


@settings(max_examples=40, deadline=None)
@given(sessions())
def test_session_json_round_trips(nodes: list[CallNode]) -> None:
    res = build_session(nodes, {"harness": "h", "session_id": "s"}, min_calls=1)
    back = session_from_json(orjson.dumps(session_to_json(res)))
    assert session_to_json(back) == session_to_json(res)


def is_prefix(a: list[int], b: list[int]) -> bool:
    return len(a) <= len(b) and b[: len(a)] == a


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sessions())
def test_drift_and_discard_labels_match_their_definitions(nodes: list[CallNode]) -> None:
    g = TrajectoryGraph(nodes)
    parent = all_pairs_parents(nodes)
    kids = {n.node_id: [m for m in nodes if parent[m.node_id] == n.node_id] for n in nodes}
    drift = set()
    for x in nodes:
        for n in nodes:
            if (
                x is not n
                and parent[x.node_id] == parent[n.node_id]
                and len(x.prompt_ids) < len(n.prompt_ids)
                and is_prefix(x.prompt_ids, n.prompt_ids)
                and not is_prefix(end(x), n.prompt_ids)
            ):
                drift.add((x.node_id, n.node_id))
    by_id = {n.node_id: n for n in nodes}

    def lcp(a: list[int], b: list[int]) -> int:
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        return k

    expected = {}
    for x_id, n_id in drift:
        x, n = by_id[x_id], by_id[n_id]
        rank = (len(x.prompt_ids), lcp(end(x), n.prompt_ids))
        cur = expected.get(n_id)
        if cur is None or rank > cur[1] or (rank == cur[1] and x.order_key() < by_id[cur[0]].order_key()):
            expected[n_id] = (x_id, rank)
    assert {d.node_id: d.nearly_extends for d in g.drift_breaks()} == {k: v[0] for k, v in expected.items()}
    for d in g.drift_breaks():
        n, x = by_id[d.node_id], by_id[d.nearly_extends]
        assert d.position == lcp(end(x), n.prompt_ids)
        assert d.sampled_offset == d.position - len(x.prompt_ids)
        assert d.lost_tokens == len(x.sampled_ids) - d.sampled_offset
    discarded = set()
    for n in nodes:
        if kids[n.node_id]:
            continue
        for s in nodes:
            if s is n or s.order_key() < n.order_key() or s.has_tools != n.has_tools:
                continue
            if parent[s.node_id] != parent[n.node_id] or (n.node_id, s.node_id) in drift:
                continue
            same_prompt = s.prompt_ids == n.prompt_ids
            if same_prompt or (kids[s.node_id] and parent[n.node_id] is not None):
                discarded.add(n.node_id)
    assert g.discarded() == discarded


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.integers(5, 40))
def test_bigger_random_sessions_match_the_reference(seed: int, n_calls: int) -> None:
    rnd = random.Random(seed)
    nodes: list[CallNode] = []
    for i in range(n_calls):
        if not nodes or rnd.random() < 0.15:
            prompt = [rnd.randrange(3) for _ in range(rnd.randrange(1, 12))]
        else:
            base = end(rnd.choice(nodes))
            prompt = base[: rnd.randrange(1, len(base) + 1)] if rnd.random() < 0.3 else list(base)
            prompt += [rnd.randrange(3) for _ in range(rnd.randrange(0, 6))]
        sampled = [rnd.randrange(3) for _ in range(rnd.randrange(0, 8))]
        lps = [-1.0] * len(sampled)
        nodes.append(
            CallNode(f"c{i}", prompt, sampled, lps, None, rnd.random() < 0.8, rnd.randrange(n_calls))
        )
    order = list(nodes)
    rnd.shuffle(order)
    g = TrajectoryGraph(order)
    assert {n.node_id: g.parent(n.node_id) for n in nodes} == all_pairs_parents(nodes)
    assert snapshot(g) == snapshot(TrajectoryGraph(nodes))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sessions(), st.integers(1, 25), st.sampled_from(["drop", "split"]))
def test_overlong_rows_respect_the_budget_and_every_lost_token_is_counted(
    nodes: list[CallNode], budget: int, mode: str
) -> None:
    g = TrajectoryGraph(nodes)
    full = build_rows(g, RowOptions(max_tokens=10**6))
    rs = build_rows(g, RowOptions(max_tokens=budget, overlong=mode))
    assert all(len(r.input_ids) <= budget for r in rs.rows)
    assert rs.overlong_rows == sum(1 for r in full.rows if len(r.input_ids) > budget)
    assert rs.overlong_rows == rs.dropped_overlong + rs.split_rows + rs.dropped_duplicate_cuts
    for r in rs.rows:
        assert r.cut == (r.row_id.endswith("#cut"))
        if r.cut:
            assert len(r.input_ids) == r.turn_ends[-1]  # cut exactly after a call's sampled tokens
    if mode == "drop":
        kept = sum(r.n_trainable for r in rs.rows)
        assert kept + rs.lost_sampled_tokens == sum(r.n_trainable for r in full.rows)
