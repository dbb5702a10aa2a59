"""Hand-built sessions: chain, retry, subagent, compaction, adoption, re-render, missing logprobs."""

from __future__ import annotations

import pytest
from traj_factory import SUB_SYSTEM, SYSTEM, call, chain, end, lp

from fineenvs.trajectory import RowOptions, TrajectoryGraph, build_rows, build_session


def test_clean_chain_is_one_row_with_exact_masks_and_logprobs() -> None:
    nodes = chain(4)
    res = build_session(nodes, {"harness": "opencode", "task_id": "t1"})
    g = res.graph
    assert g.roots() == ["n0"] and g.leaves() == ["n3"]
    assert [g.parent(f"n{k}") for k in range(4)] == [None, "n0", "n1", "n2"]
    assert g.context_ids("n2") == [250, 251]
    [row] = res.rows.rows
    assert row.input_ids == end(nodes[-1])
    assert row.node_ids == ["n0", "n1", "n2", "n3"] and row.role == "agent" and row.trainable
    for node, a, b in zip(nodes, row.turn_starts, row.turn_ends, strict=True):
        assert (a, b) == (len(node.prompt_ids), len(end(node)))
        assert row.input_ids[a:b] == node.sampled_ids
        assert row.logprobs[a:b] == node.logprobs
    sampled_pos = {i for a, b in zip(row.turn_starts, row.turn_ends, strict=True) for i in range(a, b)}
    assert [i for i, m in enumerate(row.loss_mask) if m] == sorted(sampled_pos)
    assert all(row.logprobs[i] == 0.0 for i in range(len(row.input_ids)) if i not in sampled_pos)
    assert row.metadata["task_id"] == "t1"
    assert res.trainable and res.training_rows() == [row]
    assert res.metrics.trainable_token_fraction == 1.0
    # calls are stored as deltas: the graph holds each token id once
    assert g.stats().held_tokens == g.stats().unique_tokens == len(row.input_ids)
    assert g.call("n2") == nodes[2]


def test_retry_sibling_is_discarded_and_counted() -> None:
    a = call(0, SYSTEM, [10, 11])
    p = end(a) + [20]
    b1 = call(1, p, [30, 31, 32])  # abandoned (e.g. the harness timed out and re-sent)
    b2 = call(2, p, [40, 41])
    c = call(3, end(b2) + [21], [50])
    res = build_session([a, b1, b2, c], {})
    assert res.graph.parent("n1") == "n0" and res.graph.parent("n2") == "n0"
    assert res.graph.discarded() == {"n1"}
    assert [r.row_id for r in res.rows.rows] == ["n3"]
    assert res.rows.dropped_discarded == 1
    assert {f.code for f in res.findings} >= {"discarded_turns"}
    kept = build_rows(res.graph, RowOptions(drop_discarded=False))
    roles = {r.row_id: (r.role, r.trainable) for r in kept.rows}
    assert roles == {"n1": ("discarded", False), "n3": ("agent", True)}


def test_retry_of_the_first_call_discards_the_earlier_root() -> None:
    r1 = call(0, SYSTEM, [10, 11])
    r2 = call(1, SYSTEM, [12])
    nxt = call(2, end(r2) + [20], [30])
    g = TrajectoryGraph([r1, r2, nxt])
    assert g.roots() == ["n0", "n1"] and g.discarded() == {"n0"}


def test_retries_nobody_continued_keep_only_the_last_identical_prompt() -> None:
    nodes = [call(0, SYSTEM, [10]), call(1, SYSTEM, [11]), call(2, SYSTEM, [12])]
    g = TrajectoryGraph(nodes)
    assert g.discarded() == {"n0", "n1"}


def test_subagent_is_a_second_root_and_both_rows_train() -> None:
    main = chain(3)
    sub = chain(2, start=10, system=SUB_SYSTEM)
    res = build_session(main + sub, {})
    assert res.graph.roots() == ["n0", "n10"]
    assert sorted(r.row_id for r in res.rows.rows) == ["n11", "n2"]
    assert all(r.role == "agent" and r.trainable for r in res.rows.rows)
    assert "multiple_roots" in {f.code for f in res.findings}
    assert res.graph.drift_breaks() == []  # a different system prompt is a new root, not a drift


def test_compaction_starts_a_new_root_and_summary_call_stays_on_its_path() -> None:
    a, b = chain(2)
    summary = call(2, end(b) + [7, 7], [60, 61, 62], tools=False)  # "summarise the conversation"
    d = call(3, SYSTEM + [60, 61, 62], [70])  # fresh conversation seeded with the summary
    e = call(4, end(d) + [71], [72])
    g = TrajectoryGraph([a, b, summary, d, e])
    assert g.roots() == ["n0", "n3"]
    assert g.parent("n2") == "n1" and g.parent("n4") == "n3"
    assert g.discarded() == set()
    rows = build_rows(g).rows
    assert sorted(r.node_ids[-1] for r in rows) == ["n2", "n4"]
    # the summariser has no tools but sits on an agent path: it is trained with the agent
    assert {r.row_id: r.role for r in rows} == {"n2": "agent", "n4": "agent"}


def test_title_generator_root_is_auxiliary_and_can_be_dropped() -> None:
    title = call(0, [8, 8, 8], [90, 91], tools=False)
    nodes = [title] + chain(2, start=1)
    rows = build_rows(TrajectoryGraph(nodes)).rows
    assert {r.row_id: r.role for r in rows} == {"n0": "auxiliary", "n2": "agent"}
    dropped = build_rows(TrajectoryGraph(nodes), RowOptions(drop_auxiliary=True))
    assert [r.row_id for r in dropped.rows] == ["n2"] and dropped.dropped_auxiliary == 1


def test_every_path_is_agent_when_no_call_had_tools() -> None:
    nodes = [call(0, [8, 8], [90], tools=False), call(1, [7, 7], [91], tools=False)]
    assert {r.role for r in build_rows(TrajectoryGraph(nodes)).rows} == {"agent"}


@pytest.mark.parametrize("order", [[2, 1, 0], [1, 2, 0], [2, 0, 1], [0, 2, 1]])
def test_out_of_order_arrival_adopts_orphan_roots(order: list[int]) -> None:
    nodes = chain(3)
    g = TrajectoryGraph([nodes[i] for i in order])
    assert [g.parent(f"n{k}") for k in range(3)] == [None, "n0", "n1"]
    assert g.roots() == ["n0"] and len(build_rows(g).rows) == 1
    assert build_rows(g).rows[0].input_ids == end(nodes[2])


def test_late_parent_is_reported_when_the_parent_arrived_later() -> None:
    a, b = chain(2)
    a.arrival_index, b.arrival_index = 5, 1  # the child's record landed first
    g = TrajectoryGraph([b, a])
    assert g.parent("n1") == "n0" and g.late_parents() == ["n1"]


def test_rerendered_history_forks_at_the_first_differing_token() -> None:
    a = call(0, SYSTEM, [10, 11])
    b = call(1, end(a) + [20, 21], [30, 31, 32, 33, 34, 35])
    # The harness re-rendered b's output: the first three tokens survive, then it differs.
    c_prompt = end(a) + [20, 21] + [30, 31, 32, 99, 98] + [22]
    c = call(2, c_prompt, [40, 41])
    d = call(3, end(c) + [23], [50])
    res = build_session([a, b, c, d], {})
    g = res.graph
    assert g.parent("n2") == "n0" and g.parent("n1") == "n0"
    [brk] = g.drift_breaks()
    fork = len(b.prompt_ids) + 3
    assert (brk.node_id, brk.nearly_extends, brk.position, brk.sampled_offset, brk.lost_tokens) == (
        "n2",
        "n1",
        fork,
        3,
        3,
    )
    assert c.prompt_ids[:fork] == end(b)[:fork] and c.prompt_ids[fork] != end(b)[fork]
    # lossless: b keeps its own row (not a retry), c's row continues from a
    assert g.discarded() == set()
    rows = {r.row_id: r for r in res.rows.rows}
    assert set(rows) == {"n1", "n3"}
    common = 0
    while rows["n1"].input_ids[common] == rows["n3"].input_ids[common]:
        common += 1
    assert common == fork
    assert rows["n1"].input_ids[len(b.prompt_ids) :] == b.sampled_ids
    assert "drift_breaks" in {f.code for f in res.findings}
    assert res.metrics.drift_breaks == [brk]


def test_turn_without_logprobs_is_context_only() -> None:
    nodes = chain(3)
    nodes[1].logprobs = None
    res = build_session(nodes, {})
    [row] = res.rows.rows
    a, b = row.turn_starts[1], row.turn_ends[1]
    assert row.loss_mask[a:b] == [0, 0, 0] and row.logprobs[a:b] == [0.0, 0.0, 0.0]
    assert row.input_ids[a:b] == nodes[1].sampled_ids  # still there, as context
    a0, b0 = row.turn_starts[0], row.turn_ends[0]
    assert row.loss_mask[a0:b0] == [1, 1, 1] and row.logprobs[a0:b0] == lp(nodes[0].sampled_ids)
    assert res.metrics.trainable_token_fraction == pytest.approx(6 / 9)
    codes = {f.code: f.level for f in res.findings}
    assert codes["no_logprobs"] == "warning" and res.trainable


@pytest.mark.parametrize(
    "mutate",
    [
        lambda n: setattr(n, "logprobs_aligned", False),
        lambda n: setattr(n, "logprobs", [-0.1]),  # wrong count
        lambda n: setattr(n, "logprobs", [-0.1, float("nan"), -0.2]),
    ],
)
def test_misaligned_logprobs_make_the_turn_context_only(mutate: object) -> None:
    nodes = chain(2)
    mutate(nodes[0])  # type: ignore[operator]
    res = build_session(nodes, {})
    [row] = res.rows.rows
    assert row.loss_mask[row.turn_starts[0] : row.turn_ends[0]] == [0, 0, 0]
    assert row.loss_mask[row.turn_starts[1] : row.turn_ends[1]] == [1, 1, 1]
    assert "logprob_misalign" in {f.code for f in res.findings}


def test_node_ids_must_be_unique() -> None:
    g = TrajectoryGraph([call(0, SYSTEM, [1])])
    with pytest.raises(ValueError, match="added twice"):
        g.add(call(1, SYSTEM, [2], node_id="n0"))


def test_empty_sampled_call_does_not_parent_its_own_prompt() -> None:
    empty = call(0, SYSTEM, [], logprobs=[])
    retry = call(1, SYSTEM, [10])
    nxt = call(2, SYSTEM + [10, 11], [12])
    g = TrajectoryGraph([empty, retry, nxt])
    assert g.parent("n1") is None and g.parent("n2") == "n1"
    assert g.discarded() == {"n0"}
