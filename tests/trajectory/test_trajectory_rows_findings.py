"""Shared-prefix policies, the over-long rule, validation findings, fidelity metrics."""

from __future__ import annotations

import pytest
from traj_factory import SYSTEM, call, chain, end

from fineenvs.trajectory import RowOptions, TrajectoryGraph, aggregate, build_rows, build_session, validate


def forked() -> list:  # type: ignore[type-arg]
    """a -> b and a -> c (c re-rendered b's output): two live rows sharing a's sampled tokens."""
    a = call(0, SYSTEM, [10, 11])
    b = call(1, end(a) + [20], [30, 31, 32])
    c = call(2, end(a) + [20, 30, 99], [40, 41])
    return [a, b, c]


def span(row, k: int) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    return row.turn_starts[k], row.turn_ends[k]


def test_per_row_trains_the_shared_call_in_every_row() -> None:
    r1, r2 = build_rows(TrajectoryGraph(forked()), RowOptions(shared_prefix="per_row")).rows
    for r in (r1, r2):
        a, b = span(r, 0)
        assert r.loss_mask[a:b] == [1, 1] and r.logprobs[a:b] != [0.0, 0.0] and r.loss_weight is None


def test_once_trains_the_shared_call_in_the_first_row_only() -> None:
    r1, r2 = build_rows(TrajectoryGraph(forked()), RowOptions(shared_prefix="once")).rows
    a, b = span(r1, 0)
    assert r1.loss_mask[a:b] == [1, 1]
    assert r2.loss_mask[a:b] == [0, 0] and r2.logprobs[a:b] == [0.0, 0.0]
    # the leaves are unshared and stay trainable in both rows
    assert r1.loss_mask[slice(*span(r1, 1))] == [1, 1, 1] and r2.loss_mask[slice(*span(r2, 1))] == [1, 1]
    assert r1.trainable and r2.trainable


def test_inverse_count_weights_shared_tokens_by_one_over_rows() -> None:
    r1, r2 = build_rows(TrajectoryGraph(forked()), RowOptions(shared_prefix="inverse_count")).rows
    for r in (r1, r2):
        assert r.loss_weight is not None
        a, b = span(r, 0)
        assert r.loss_weight[a:b] == [0.5, 0.5] and r.loss_mask[a:b] == [1, 1]
        a, b = span(r, 1)
        assert set(r.loss_weight[a:b]) == {1.0}
        assert sum(r.loss_weight) == pytest.approx(0.5 * 2 + (b - a))


def test_discarded_rows_do_not_count_as_sharing() -> None:
    a = call(0, SYSTEM, [10])
    b1 = call(1, end(a) + [20], [30])
    b2 = call(2, end(a) + [20], [31])
    c = call(3, end(b2) + [21], [40])
    [row] = build_rows(TrajectoryGraph([a, b1, b2, c]), RowOptions(shared_prefix="inverse_count")).rows
    assert row.loss_weight is not None and row.loss_weight[slice(*span(row, 0))] == [1.0]


@pytest.mark.parametrize("bad", [{"overlong": "truncate"}, {"shared_prefix": "half"}, {"max_tokens": 0}])
def test_bad_options_are_refused_with_the_key(bad: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=next(iter(bad))):
        build_rows(TrajectoryGraph(chain(2)), RowOptions(**bad))


def test_overlong_drop_and_split_are_counted() -> None:
    nodes = chain(4)  # ends at 8, 13, 18, 23 tokens
    assert [len(end(n)) for n in nodes] == [8, 13, 18, 23]
    g = TrajectoryGraph(nodes)
    dropped = build_rows(g, RowOptions(max_tokens=15, overlong="drop"))
    assert dropped.rows == [] and dropped.overlong_rows == 1 and dropped.dropped_overlong == 1
    assert dropped.lost_sampled_tokens == 12
    cut = build_rows(g, RowOptions(max_tokens=15, overlong="split"))
    [row] = cut.rows
    assert row.cut and row.node_ids == ["n0", "n1"] and row.input_ids == end(nodes[1])
    assert (cut.split_rows, cut.dropped_overlong, cut.lost_sampled_tokens) == (1, 0, 6)
    assert sum(row.loss_mask) == 6
    too_small = build_rows(g, RowOptions(max_tokens=7, overlong="split"))
    assert too_small.rows == [] and too_small.dropped_overlong == 1
    findings = {f.code: f for f in validate(g, cut)}
    assert "6 trainable tokens lost" in findings["overlong_rows"].message


def test_two_leaves_cut_to_the_same_call_are_kept_once() -> None:
    a, b = chain(2)
    c1 = call(2, end(b) + [7] * 10, [1])
    c2 = call(3, end(b) + [8] * 10, [2])
    rs = build_rows(TrajectoryGraph([a, b, c1, c2]), RowOptions(max_tokens=15, overlong="split"))
    assert [r.row_id for r in rs.rows] == ["n1#cut"] and rs.dropped_duplicate_cuts == 1


def codes(res) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {f.code: f.level for f in res.findings}


def test_no_calls_is_fatal_and_exports_nothing() -> None:
    res = build_session([], {})
    assert codes(res) == {"no_calls": "fatal"}
    assert res.training_rows() == [] and "never reached" in (res.refusal or "")


def test_a_single_call_is_degenerate_unless_allowed() -> None:
    res = build_session(chain(1), {})
    assert codes(res)["degenerate_session"] == "fatal"
    assert res.rows.rows and all(not r.trainable for r in res.rows.rows) and res.training_rows() == []
    assert "degenerate_session" in (res.refusal or "")
    assert build_session(chain(1), {}, min_calls=1).trainable


def test_missing_prompt_ids_and_positive_logprobs_are_fatal() -> None:
    nodes = chain(3)
    nodes[1].logprobs = [-0.1, 0.3, -0.2]
    res = build_session([*nodes, call(9, [], [5])], {})
    c = codes(res)
    assert c["positive_logprob"] == "fatal" and c["no_prompt_ids"] == "fatal"
    assert "n1" in (res.refusal or "") and "n9" in (res.refusal or "")
    assert res.training_rows() == []


def test_nothing_trainable_is_fatal() -> None:
    nodes = chain(2)
    for n in nodes:
        n.logprobs = None
    res = build_session(nodes, {})
    assert codes(res)["nothing_trainable"] == "fatal" and codes(res)["no_logprobs"] == "warning"


def test_retry_storm_per_turn_capture_and_late_parents() -> None:
    a = call(0, SYSTEM, [10])
    p = end(a) + [20]
    retries = [call(k, p, [30 + k]) for k in range(1, 5)]
    res = build_session([a, *retries], {})
    assert codes(res)["retry_storm"] == "warning"
    assert "3 retries after call n0" in next(f.message for f in res.findings if f.code == "retry_storm")
    # every call re-rendered from scratch: all roots
    per_turn = [call(0, [1, 2], [3, 4]), call(1, [1, 2, 3, 9], [5]), call(2, [1, 2, 3, 9, 7, 8], [6])]
    c = codes(build_session(per_turn, {}))
    assert c["per_turn_capture_only"] == "warning" and c["drift_breaks"] == "warning"
    a2, b2 = chain(2)
    a2.arrival_index = 7
    assert codes(build_session([a2, b2], {}))["late_parents"] == "info"


def test_fidelity_metrics_and_per_harness_aggregation() -> None:
    a = call(0, SYSTEM, [10, 11])
    b1 = call(1, end(a) + [20], [30, 31, 32])
    b2 = call(2, end(a) + [20], [40])
    c = call(3, end(b2) + [21], [50], logprobs=None)
    s1 = build_session([a, b1, b2, c], {"harness": "codex"}).metrics
    assert (s1.n_calls, s1.n_roots, s1.n_forks, s1.n_discarded, s1.n_rows) == (4, 1, 1, 1, 1)
    assert s1.sampled_tokens == 7 and s1.trainable_tokens == 3  # a (2) + b2 (1); b1 discarded, c no logprobs
    s2 = build_session(chain(3), {"harness": "codex"}).metrics
    s3 = build_session(chain(2), {"harness": "opencode"}).metrics
    agg = aggregate([s1, s2, s3])
    assert agg["codex"].n_sessions == 2 and agg["codex"].rows_per_attempt == 1.0
    assert agg["codex"].trainable_token_fraction == pytest.approx((3 + 9) / (7 + 9))
    logged = agg["opencode"].log_dict()
    assert logged["fidelity/opencode/trainable_token_fraction"] == 1.0


def test_constrained_calls_are_context_unless_asked_and_are_counted() -> None:
    """A structured-output call's logprobs are the grammar-masked distribution's: context only by
    default, trained with RowOptions(train_constrained=True), counted in the fidelity metrics."""
    a = call(0, SYSTEM, [10, 11])
    b = call(1, end(a) + [20], [30, 31, 32])
    b.constrained = True
    (row,) = build_rows(TrajectoryGraph([a, b]), RowOptions()).rows
    assert row.loss_mask[slice(*span(row, 0))] == [1, 1]
    assert (
        row.loss_mask[slice(*span(row, 1))] == [0, 0, 0] and row.logprobs[slice(*span(row, 1))] == [0.0] * 3
    )
    (trained,) = build_rows(TrajectoryGraph([a, b]), RowOptions(train_constrained=True)).rows
    assert trained.loss_mask[slice(*span(trained, 1))] == [1, 1, 1]
    session = build_session([a, b], {"harness": "claude_code"})
    assert session.metrics.n_constrained == 1
    assert (
        aggregate([session.metrics])["claude_code"].log_dict()["fidelity/claude_code/constrained_calls"]
        == 1.0
    )


def test_a_row_with_a_trained_call_of_unknown_version_has_no_version() -> None:
    """The row's version is the oldest of its trained calls; one without a version may be older
    than all the others, so the row's staleness is unknown rather than the others' minimum."""
    from dataclasses import replace

    nodes = chain(3)
    versioned = [replace(n, weight_version=v) for n, v in zip(nodes, (5, 4, 6), strict=True)]
    (row,) = build_rows(TrajectoryGraph(versioned), RowOptions()).rows
    assert row.weight_version == 4
    one_unknown = [*versioned[:2], replace(versioned[2], weight_version=None)]
    (row,) = build_rows(TrajectoryGraph(one_unknown), RowOptions()).rows
    assert row.weight_version is None


def test_options_round_trip_as_json() -> None:
    """A session file stores its row options as plain JSON (the modes by name) and reads them back."""
    import json

    options = RowOptions(max_tokens=15, overlong="split", shared_prefix="once", drop_discarded=False)
    doc = options.to_json()
    assert doc["overlong"] == "split" and doc["shared_prefix"] == "once"
    assert json.loads(json.dumps(doc)) == doc
    assert RowOptions(**doc) == options
