"""The report's statistics on synthetic evaluation records, against figures worked out by hand: the
two-sided sign test, tool calls on co-solved cells with their bootstrap interval, the issue's
targets (1)-(6), the unseen harness in the matrix and the paired table, the sweep's per-run targets."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fineenvs.results import EvalAttempt
from fineenvs_recipes.mini_repro import stats
from fineenvs_recipes.mini_repro.recipe import DONE, _stage_label, eval_data, pooled_table, summary_table

STAGE_NAMES = ("base", "rl_one", "rl_mix", "rl_mix_nobonus", "sft_mix")
N = 12  # tasks t0..t11 per harness


def test_two_sided_sign_test() -> None:
    # 5 / 0: one tail 1/32, both 1/16; 3 / 3: one tail 42/64 > 1/2, so the doubled tail caps at 1.
    assert stats.two_sided_sign_p(5, 0) == pytest.approx(1 / 16)
    assert stats.two_sided_sign_p(0, 5) == pytest.approx(1 / 16)
    assert stats.two_sided_sign_p(3, 3) == 1.0 and stats.two_sided_sign_p(0, 0) == 1.0


def test_call_ratio_and_its_bootstrap_interval() -> None:
    same = stats.call_ratio([(1.0, 2.0)] * 5)  # always half the calls: no spread to resample
    assert (
        same.change == pytest.approx(-0.5)
        and same.low == pytest.approx(-0.5)
        and same.high == pytest.approx(-0.5)
    )
    assert (same.cells, same.fewer, same.more, same.mean_a, same.mean_b) == (5, 5, 0, 1.0, 2.0)
    # Three cells at half the calls, one equal: 5 / 8 calls, -37.5 %. A resample can do no better
    # than all-halved (-50 %) and no worse than all-equal (0 %), so the interval lies in between.
    mixed = stats.call_ratio([(1.0, 2.0)] * 3 + [(2.0, 2.0)])
    assert mixed.change == pytest.approx(-0.375) and (mixed.fewer, mixed.more) == (3, 0)
    assert mixed.low is not None and mixed.high is not None
    assert -0.5 <= mixed.low < -0.375 < mixed.high <= 0.0
    assert (
        stats.call_ratio([(1.0, 2.0)] * 3 + [(2.0, 2.0)]) == mixed
    )  # seeded: the same records, the same interval
    # Symmetric: one cell fewer, one more, same totals: 0 %, and the interval straddles it.
    sym = stats.call_ratio([(1.0, 2.0), (2.0, 1.0), (1.0, 1.0), (2.0, 2.0)])
    assert sym.change == pytest.approx(0.0) and sym.low is not None and sym.high is not None
    assert sym.low < 0.0 < sym.high and (sym.fewer, sym.more) == (1, 1)
    empty = stats.call_ratio([])
    assert empty.cells == 0 and empty.change is None and stats.format_change(empty) == "0 cells"
    assert stats.format_change(same) == "5 cells: 2.00 → 1.00, -50 % [-50, -50]"


def _attempt(stage: str, t: int, h: str, solved: bool, calls: int | None) -> EvalAttempt:
    return EvalAttempt(stage, f"t{t}", h, 0, f"{stage}-{h}-{t}", 1.0 if solved else 0.0, tool_calls=calls)


def test_co_solved_cells_are_those_both_solved_with_a_tool_count() -> None:
    a = {
        ("t0", "pi"): _attempt("a", 0, "pi", True, 1),
        ("t1", "pi"): _attempt("a", 1, "pi", True, 3),
        ("t2", "pi"): _attempt("a", 2, "pi", True, None),  # no tool count: left out
        ("t3", "pi"): _attempt("a", 3, "pi", False, 1),  # a unsolved: left out
        ("t0", "codex"): _attempt("a", 0, "codex", True, 1),  # another harness: left out
    }
    b = {k: _attempt("b", int(k[0][1:]), k[1], True, 2) for k in a}
    assert stats.co_solved_calls(a, b, ["pi"]) == [(1.0, 2.0), (3.0, 2.0)]


# The synthetic run: mix pi + mini_swe_agent, unseen codex, 12 tasks. Which tasks each checkpoint
# solves, per harness, and its tool calls on them (calls[stage] maps a task to its count; 2 if absent).
SOLVED = {
    "base": {"pi": range(7), "mini_swe_agent": range(1), "codex": range(0)},
    "rl_one": {"pi": range(12), "mini_swe_agent": range(2), "codex": range(0)},
    "rl_mix": {"pi": range(10), "mini_swe_agent": range(5), "codex": range(2)},
    "rl_mix_nobonus": {"pi": range(10), "mini_swe_agent": range(5), "codex": range(0)},
    "sft_mix": {"pi": range(6), "mini_swe_agent": range(1), "codex": range(0)},
}
CALLS = {
    "rl_one": dict.fromkeys(range(N), 1),
    "rl_mix": dict.fromkeys(range(N), 1),
    "sft_mix": {0: 1, 1: 1, 2: 1},
}


def _write_run(
    out: Path,
    solved: dict[str, dict[str, range]] = SOLVED,
    seed: int = 0,
    calls: dict[str, dict[int, int]] = CALLS,
) -> None:
    keys = {s: str(out / s / "checkpoints" / "step-12") for s in solved}
    for stage, harnesses in (("eval", ["pi", "mini_swe_agent"]), ("eval_unseen", ["codex"])):
        results = {
            "harnesses": harnesses,
            "tasks": N,
            "checkpoints": list(keys.values()),
            "cells": {
                keys[s]: {h: {"solved": len(solved[s][h]), "tasks": N} for h in harnesses} for s in solved
            },
            "overall": {},
        }
        (out / stage / "eval").mkdir(parents=True)
        (out / stage / "eval" / "results.json").write_text(json.dumps(results))
        records = [
            {
                "checkpoint": keys[s], "task_id": f"t{t}", "harness": h, "try_index": 0,
                "attempt_id": f"{s}-{h}-{t}", "reward": 1.0 if t in solved[s][h] else 0.0,
                "tool_calls": calls.get(s, {}).get(t, 2), "model_calls": 2, "prompt_tokens": 2000 * (3 if h == "codex" else 1),
                "duration_seconds": 30.0 if h == "codex" else 10.0,
            }
            for s in solved for h in harnesses for t in range(N)
        ]  # fmt: skip
        (out / stage / "eval" / "attempts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for stage, seconds in (("teacher", 120), ("rl_mix_nobonus", 1200), ("eval", 900), ("eval_unseen", 180)):
        (out / stage).mkdir(exist_ok=True)
        (out / stage / DONE).write_text(json.dumps({"seconds": seconds, "extra": [f"seed={seed}"]}))
    (out / "rl_one").mkdir(exist_ok=True)
    rl_one = {"seconds": 300, "runs": [["job=rl", "harness=[pi]"]], "extra": [f"seed={seed}"]}
    (out / "rl_one" / DONE).write_text(json.dumps(rl_one))


def test_stage_labels_tell_rl_mix_from_its_control(tmp_path: Path) -> None:
    assert _stage_label(tmp_path, str(tmp_path / "rl_mix_nobonus" / "final")) == "rl_mix_nobonus"
    assert _stage_label(tmp_path, str(tmp_path / "rl_mix" / "final")) == "rl_mix"
    assert _stage_label(tmp_path, "/x/rl_mix_nobonus/checkpoints/step-12") == "rl_mix_nobonus"


def test_the_targets_on_a_run_worked_out_by_hand(tmp_path: Path) -> None:
    _write_run(tmp_path)
    ev = eval_data(tmp_path)
    assert ev is not None and ev.mix == ["pi", "mini_swe_agent"] and ev.unseen == ["codex"]
    assert list(ev.finals) == list(STAGE_NAMES) and len(ev.task_ids) == N
    found = {t.number: t for t in stats.targets(ev.finals, ev.task_ids, ev.mix, ev.unseen, "pi")}
    # (1) base: pi 7 of 12, mini_swe_agent 1; tasks t1-t6 solved in pi only, none the other way:
    # 6 / 0, two-sided 2 / 2^6 = 1/32, one pair of harnesses.
    assert found[1].status == "reached" and found[1].details["p"] == pytest.approx(1 / 32)
    # The pairing resolves what the intervals do not: Wilson 7/12 from 0.32, 1/12 up to 0.35.
    assert (found[1].details["won"], found[1].details["lost"]) == (6, 0) and not found[1].details["disjoint"]
    assert "Wilson intervals overlap" in found[1].figure
    # (2) rl_one in pi: t7-t11 won, none lost: 5 / 0, one-sided 1/32; gain 5/12 against 1/12 in mini_swe_agent.
    assert found[2].status == "reached" and found[2].details["p"] == pytest.approx(1 / 32)
    assert found[2].details["gain"] == pytest.approx(5 / 12)
    assert found[2].details["other_gains"] == {"mini_swe_agent": pytest.approx(1 / 12)}
    # (3) rl_mix: pi 3 / 0, mini_swe_agent 4 / 0, overall 7 / 0: p = 1/128, every harness up.
    assert found[3].status == "reached" and found[3].details["p"] == pytest.approx(1 / 128)
    assert "7 / 0" in found[3].figure and "pi 3 / 0, mini_swe_agent 4 / 0" in found[3].figure
    # (4) rl_mix vs sft_mix: pi t6-t9, mini_swe_agent t1-t4: 8 / 0, p = 1/256.
    assert found[4].status == "reached" and found[4].details["p"] == pytest.approx(1 / 256)
    # (5) co-solved by rl_mix and its control: pi t0-t9 and mini_swe_agent t0-t4, 1 call against 2.
    assert found[5].status == "reached" and found[5].details["cells"] == 15
    assert found[5].details["change"] == pytest.approx(-0.5) and found[5].details["high"] == pytest.approx(
        -0.5
    )
    # (6) codex: only rl_mix solves anything (t0, t1): 2 / 0 against the base, two-sided 2 / 4.
    assert found[6].status == "measured"
    assert "rl_mix 0.17 (2 / 0, p = 0.5)" in found[6].figure and "codex: base 0.00" in found[6].figure
    # The same run with the control as frugal as rl_mix: no cut, target (5) missed; rl_one also
    # gaining in mini_swe_agent as much as in pi misses (2).
    frugal = {**SOLVED, "rl_one": {**SOLVED["rl_one"], "mini_swe_agent": range(6)}}
    _write_run(tmp_path / "frugal", frugal, calls={**CALLS, "rl_mix_nobonus": dict.fromkeys(range(N), 1)})
    ev2 = eval_data(tmp_path / "frugal")
    assert ev2 is not None
    again = {t.number: t for t in stats.targets(ev2.finals, ev2.task_ids, ev2.mix, ev2.unseen, "pi")}
    assert again[5].status == "missed" and again[5].details["change"] == pytest.approx(0.0)
    assert again[2].status == "missed" and again[2].details["other_gains"]["mini_swe_agent"] == pytest.approx(
        5 / 12
    )
    # A run without the control: (5) not measured, naming the stage it lacks.
    del ev2.finals["rl_mix_nobonus"]
    lacking = stats.targets(ev2.finals, ev2.task_ids, ev2.mix, [], "pi")
    assert lacking[4].status == "not measured" and lacking[4].details["missing"] == ["rl_mix_nobonus"]
    assert lacking[5].status == "not measured"


def test_the_report_shows_the_unseen_harness_the_bonus_and_the_targets(tmp_path: Path) -> None:
    _write_run(tmp_path)
    table = summary_table(tmp_path)
    # The matrix: the mix, "all" over the mix, then codex apart. base: 7 and 1 of 12, 8 of 24; codex
    # 0 of 12, whose Wilson upper bound is 1.96² / (12 + 1.96²) = 0.24.
    assert "| checkpoint | pi | mini_swe_agent | all | codex (unseen) |" in table
    assert re.search(
        r"\| base \| 0\.58 \[[^]]+\] \| 0\.08 \[[^]]+\] \| 0\.33 \[[^]]+\] \| 0\.00 \[0\.00, 0\.24\] \|",
        table,
    )
    # Paired: rl_mix vs base, pi 3 / 0 (1/8), mini_swe_agent 4 / 0 (1/16), all 7 / 0 (1/128), codex 2 / 0 (1/4).
    assert (
        "| rl_mix vs base | 3 / 0 (p = 0.12) | 4 / 0 (p = 0.062) | 7 / 0 (p = 0.0078) | 2 / 0 (p = 0.25) |"
        in table
    )
    # Tool calls: rl_one 1 call, the base 2, on pi t0-t6 and mini_swe_agent t0.
    assert (
        "| rl_one vs base | 7 cells: 2.00 → 1.00, -50 % [-50, -50] | 1 cells: 2.00 → 1.00, -50 % [-50, -50] "
        in table
    )
    # sft_mix against the base over the mix: pi t0-t5 (1, 1, 1, 2, 2, 2 against 2 each) and
    # mini_swe_agent t0 (1 against 2): 10 / 14 calls, -29 %, interval within [-50 %, 0 %].
    row = next(line for line in table.splitlines() if line.startswith("| sft_mix vs base | 6 cells"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3].startswith("7 cells: 2.00 → 1.43, -29 % [")
    low, high = (int(x) for x in re.findall(r"\[([-+]\d+), ([-+]\d+)\]", cells[3])[0])
    assert -50 <= low < -29 < high <= 0
    assert cells[4] == "0 cells"  # codex: the base solved nothing there
    assert (
        "rl_mix (bonus) uses 50 % fewer tool calls than rl_mix_nobonus on 15 co-solved cells of the mix "
        "[95 % CI -50 %, -50 %]; fewer in 15 cells, more in 0." in table
    )
    # The targets section: each with its test and result; rl_one's harness read from its STAGE_DONE.
    assert table.count("**reached**") == 5 and "**measured**" in table
    assert "| (2) RL in one harness (pi) lifts it" in table
    assert "- codex: 3000 prompt tokens per call, 30 s per attempt" in table
    assert "- pi: 1000 prompt tokens per call, 10 s per attempt" in table
    # Stage times, and their sum: 120 + 300 + 1200 + 900 + 180 s = 45 min.
    assert (
        "Wall time per stage: teacher 120s, rl_one 300s, rl_mix_nobonus 1200s, eval 900s, eval_unseen 180s; "
        "all 45 min" in table
    )


def test_a_run_without_the_new_stages_reports_as_before(tmp_path: Path) -> None:
    """An older run's folder (no control, no unseen evaluation): the matrix has no unseen column and
    the targets that need the new stages say so."""
    old = {s: SOLVED[s] for s in ("base", "rl_one", "rl_mix", "sft_mix")}
    _write_run(tmp_path, old)
    for path in (tmp_path / "eval_unseen").iterdir():
        if path.is_dir():
            for f in path.iterdir():
                f.unlink()
            path.rmdir()
    table = summary_table(tmp_path)
    assert (
        "| checkpoint | pi | mini_swe_agent | all |\n" in table and "unseen" not in table.split("Paired")[0]
    )
    assert "| (5) " in table and table.count("**not measured**") == 2


def test_the_sweep_counts_each_target_over_its_runs(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    _write_run(sweep / "0", seed=0)
    weaker = {**SOLVED, "rl_mix": {**SOLVED["rl_mix"], "mini_swe_agent": range(1)}}  # mini_swe_agent 0 / 0
    _write_run(sweep / "1", weaker, seed=1)
    table = pooled_table([sweep / "0", sweep / "1"])
    assert "| target | 0 | 1 | runs reached |" in table
    assert "| (3) | reached | missed | 1 of 2 |" in table and "| (1) | reached | reached | 2 of 2 |" in table
    assert "| (6) | measured | measured | - |" in table
    # The bonus pooled: 15 + 11 co-solved cells (run 1: pi t0-t9 and mini_swe_agent t0), 1 call against 2.
    assert "rl_mix vs rl_mix_nobonus (the bonus against its control" in table
    assert "26 cells: 2.00 → 1.00, -50 % [-50, -50]" in table


def test_bonus_accounting_counts_the_groups_where_the_bonus_is_the_whole_signal(tmp_path: Path) -> None:
    """Four groups of an RL stage's attempts, worked by hand: g1 all correct with 1 and 2 calls (the
    bonus alone separates them), g2 all correct with 1 call each (no signal), g3 one correct one
    wrong (signal from correctness), g4 one graded attempt and one lost to the infrastructure."""

    def att(group: str, version: int, correct: bool, calls: int, exit_reason: str = "finished") -> dict:
        reward = (1.0 + 0.1 * 15 / (15 + calls)) if correct else 0.0
        return {
            "group_id": group,
            "policy_version": version,
            "harness": "pi",
            "reward": None if exit_reason == "infra_failure" else reward,
            "reward_terms": {"correctness": 1.0 if correct else 0.0},
            "tool_calls": calls,
            "exit_reason": exit_reason,
        }

    attempts = [
        att("g1", 0, True, 1), att("g1", 0, True, 2),
        att("g2", 1, True, 1), att("g2", 1, True, 1),
        att("g3", 2, True, 2), att("g3", 2, False, 1),
        att("g4", 3, True, 1), att("g4", 3, False, 0, "infra_failure"),
    ]  # fmt: skip
    attempts.append({**att("g5", 4, True, 3), "harness": "opencode"})  # a group of one: no group
    b = stats.bonus_accounting(attempts)
    assert (b.groups, b.signal_groups, b.bonus_only_groups) == (3, 2, 1)
    # Pi's correct attempts by policy version: 1, 2 (v0), 1 | 1 (v1), 2 (v2), 1 (v3); opencode's
    # one correct attempt falls in its second half.
    assert b.correct_calls["pi"] == (pytest.approx(4 / 3), pytest.approx(4 / 3))
    assert b.correct_calls["opencode"] == (None, 3.0)
    text = stats.format_bonus_accounting(b)
    assert "with signal 2, of which 1 all correct" in text and "opencode - → 3.00, pi 1.33 → 1.33" in text
    # In the report, per RL stage.
    (tmp_path / "rl_mix").mkdir()
    (tmp_path / "rl_mix" / "attempts.jsonl").write_text("".join(json.dumps(a) + "\n" for a in attempts))
    assert "- tool calls: groups with two or more graded attempts 3, with signal 2" in summary_table(tmp_path)


def test_the_report_counts_cells_by_the_deciding_attempts_not_the_eval_jobs_summary(tmp_path: Path) -> None:
    """A report rebuilt under today's rule for which attempt decides a cell: rl_mix's codex task t5
    crashed on a reply cut at the output cap (try 0) and was solved on a retry (try 1), which an
    older rule counted (results.json says 3 solved). The cut-off crash now decides the cell: 2 of 12
    in the matrix, as in the paired tests."""
    _write_run(tmp_path)
    keys = json.loads((tmp_path / "eval_unseen" / "eval" / "results.json").read_text())["checkpoints"]
    rl_mix = next(k for k in keys if "/rl_mix/" in k)
    path = tmp_path / "eval_unseen" / "eval" / "attempts.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    t5 = next(r for r in records if r["checkpoint"] == rl_mix and r["task_id"] == "t5")
    t5.update(reward=0.0, exit_reason="crashed", answered=False, cut_off_calls=1)
    records.append({**t5, "try_index": 1, "attempt_id": "retry", "reward": 1.0, "exit_reason": "finished",
                    "answered": True, "cut_off_calls": 0})  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    results = json.loads((tmp_path / "eval_unseen" / "eval" / "results.json").read_text())
    results["cells"][rl_mix]["codex"]["solved"] = 3
    (tmp_path / "eval_unseen" / "eval" / "results.json").write_text(json.dumps(results))
    row = next(line for line in summary_table(tmp_path).splitlines() if line.startswith("| rl_mix |"))
    assert row.rstrip(" |").endswith("| 0.17 [0.05, 0.45]")  # 2 of 12, not 3


def test_target_2_is_read_in_the_harness_rl_one_trained_in(tmp_path: Path) -> None:
    """``recipe.rl_one_harness``: the report takes rl_one's harness from its ``STAGE_DONE``."""
    _write_run(tmp_path)
    done = tmp_path / "rl_one" / DONE
    done.write_text(
        json.dumps({**json.loads(done.read_text()), "runs": [["job=rl", "harness=[mini_swe_agent]"]]})
    )
    row = next(line for line in summary_table(tmp_path).splitlines() if line.startswith("| (2)"))
    # rl_one in mini_swe_agent: t1 won, none lost (1 / 0, p = 1/2), +1/12 there against +5/12 in pi: missed.
    assert "RL in one harness (mini_swe_agent)" in row and "mini_swe_agent 1 / 0, p = 0.5, +0.08" in row
    assert "pi 5 / 0" in row and row.rstrip(" |").endswith("**missed**")
