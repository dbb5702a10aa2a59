"""Evaluation results from synthetic attempts: first graded attempt, infra retries, co-solved tool
calls (numbers worked out by hand), the results.json the local report reads, and resume."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from fineenvs.jobs.errors import EvalError
from fineenvs.jobs.eval import run_cells
from fineenvs.report import write_report
from fineenvs.results import (
    EvalAttempt,
    compute_results,
    deciding_attempts,
    eval_metrics,
    first_graded,
    format_tables,
    paired,
    read_attempts,
    write_results,
)
from fineenvs.rollout.schedule import PlannedGroup
from fineenvs.rollout.scheduler import AttemptOutcome


def _a(
    ckpt: str,
    task: str,
    harness: str,
    *,
    reward: float | None,
    try_index: int = 0,
    exit_reason: str = "finished",
    answered: bool = True,
    tools: int | None = None,
    completion: int = 0,
) -> EvalAttempt:
    return EvalAttempt(
        checkpoint=ckpt,
        task_id=task,
        harness=harness,
        try_index=try_index,
        attempt_id=f"{task}-{harness}-try{try_index}",
        reward=reward,
        exit_reason=exit_reason,
        answered=answered,
        tool_calls=tools,
        completion_tokens=completion,
    )


# --------------------------------------------------------------------------- classification


@pytest.mark.parametrize(
    ("reward", "exit_reason", "answered", "cut_off", "infra"),
    [
        (None, "finished", True, 0, True),  # ungraded
        (0.0, "wiring_failure", False, 0, True),
        (0.0, "crashed", False, 0, True),
        (0.0, "timeout", False, 0, True),
        (1.0, "timeout", True, 0, False),  # answered before the clock ran out: graded
        (0.0, "crashed", True, 0, False),  # crashed after answering: graded on its answer
        (0.0, "finished", False, 0, False),  # finished without an answer: a wrong answer, not infra
        (0.0, "budget_stop", False, 0, False),
        (0.0, "context_overflow", False, 0, False),
        # The agent failed on the policy's own reply cut at the token cap (Codex, Gemini CLI): the
        # policy's failure, graded like the same reply elsewhere, not a second draw.
        (0.0, "crashed", False, 1, False),
        (0.0, "timeout", False, 2, False),
        (None, "crashed", False, 1, True),  # still ungraded: nothing to count
    ],
)
def test_infra_failure_classification(
    reward: float | None, exit_reason: str, answered: bool, cut_off: int, infra: bool
) -> None:
    a = _a("c", "t", "h", reward=reward, exit_reason=exit_reason, answered=answered)
    a.cut_off_calls = cut_off
    assert a.infra_failure is infra


def test_first_graded_attempt_decides_the_cell() -> None:
    attempts = [
        _a("c", "t", "h", reward=1.0, try_index=2),  # a later, correct attempt does not count
        _a("c", "t", "h", reward=None, try_index=0),
        _a("c", "t", "h", reward=0.0, try_index=1),
    ]
    final = first_graded(attempts)
    assert final is not None and final.try_index == 1 and final.reward == 0.0
    assert first_graded([_a("c", "t", "h", reward=None)]) is None


# --------------------------------------------------------------------------- results by hand

# Two checkpoints, two harnesses, three tasks. Solved (S) / wrong (W) / ungraded (U), tool calls:
#            opencode          codex
#   base     t1 S 10, t2 S 6,  t1 S 8, t2 W 3, t3 U (crash, crash, crash)
#            t3 W 4
#   rl       t1 S 4,  t2 S 6,  t1 S 4, t2 S 2, t3 W 5 (after one crash)
#            t3 S 1
# base pass@1: opencode 2/3, codex 1/3, overall 3/6. rl: opencode 3/3, codex 2/3, overall 5/6.
# Co-solved cells (solved by both): (t1,opencode) 10->4, (t2,opencode) 6->6, (t1,codex) 8->4.
# Means 8 -> 14/3; reduction = 1 - (14/3)/8 = 5/12. Per harness: opencode 8 -> 5 (3/8), codex 8 -> 4 (1/2).
TASKS = ["t1", "t2", "t3"]
HARNESSES = ["opencode", "codex"]


def _synthetic() -> list[EvalAttempt]:
    return [
        _a("base", "t1", "opencode", reward=1.0, tools=10, completion=100),
        _a("base", "t2", "opencode", reward=1.0, tools=6, completion=50),
        _a("base", "t3", "opencode", reward=0.0, tools=4, exit_reason="timeout", answered=True),
        _a("base", "t1", "codex", reward=1.0, tools=8),
        _a("base", "t2", "codex", reward=0.0, tools=3, exit_reason="context_overflow"),
        *[
            _a("base", "t3", "codex", reward=0.0, try_index=i, exit_reason="crashed", answered=False)
            for i in range(3)
        ],
        _a("rl", "t1", "opencode", reward=1.05, tools=4),
        _a("rl", "t2", "opencode", reward=1.0, tools=6),
        _a("rl", "t3", "opencode", reward=1.0, tools=1),
        _a("rl", "t1", "codex", reward=1.0, tools=4),
        _a("rl", "t2", "codex", reward=1.0, tools=2),
        _a("rl", "t3", "codex", reward=None, try_index=0, exit_reason="crashed", answered=False),
        _a("rl", "t3", "codex", reward=0.0, try_index=1, tools=5),
        # An attempt of another checkpoint or task is ignored.
        _a("other", "t1", "codex", reward=1.0, tools=1),
        _a("rl", "t9", "codex", reward=1.0, tools=1),
    ]


def _results() -> dict:
    return compute_results(
        _synthetic(), checkpoints=["base", "rl"], harnesses=HARNESSES, task_ids=TASKS, split="test"
    )


def test_pass_at_1_matrix_and_overall() -> None:
    r = _results()
    assert r["pass_at_1"] == {
        "base": {"opencode": pytest.approx(2 / 3), "codex": pytest.approx(1 / 3)},
        "rl": {"opencode": 1.0, "codex": pytest.approx(2 / 3)},
    }
    assert r["overall"] == {"base": pytest.approx(0.5), "rl": pytest.approx(5 / 6)}
    assert r["baseline"] == "base" and r["checkpoints"] == ["base", "rl"] and r["tasks"] == 3


def test_cell_details() -> None:
    cells = _results()["cells"]
    codex_base = cells["base"]["codex"]
    assert codex_base["graded"] == 2 and codex_base["ungraded"] == 1 and codex_base["solved"] == 1
    assert codex_base["attempts"] == 5 and codex_base["infra_failures"] == 3
    assert codex_base["pass_at_1_graded"] == pytest.approx(0.5)
    assert codex_base["context_overflows"] == 1 and codex_base["timeouts"] == 0
    assert codex_base["tool_calls_mean"] == pytest.approx(5.5)  # (8 + 3) / 2, the ungraded cell has none
    oc_base = cells["base"]["opencode"]
    assert oc_base["timeouts"] == 1 and oc_base["completion_tokens"] == 150
    assert oc_base["tool_calls_mean_solved"] == pytest.approx(8.0)
    rl_codex = cells["rl"]["codex"]
    assert rl_codex["graded"] == 3 and rl_codex["infra_failures"] == 1 and rl_codex["attempts"] == 4
    assert rl_codex["exit_reasons"] == {"finished": 3}


def test_tool_call_reduction_on_co_solved_tasks() -> None:
    r = _results()
    assert r["tool_call_reduction"] == {"rl vs base": pytest.approx(5 / 12)}
    d = r["co_solved"]["rl vs base"]
    assert d["cells"] == 3
    assert d["mean_tool_calls_base"] == pytest.approx(8.0) and d["mean_tool_calls"] == pytest.approx(14 / 3)
    assert d["per_harness"]["opencode"]["reduction"] == pytest.approx(3 / 8)
    assert d["per_harness"]["codex"]["reduction"] == pytest.approx(0.5)
    assert d["per_harness"]["codex"]["cells"] == 1


def test_no_co_solved_cells_gives_no_reduction() -> None:
    attempts = [_a("a", "t1", "h", reward=1.0, tools=3), _a("b", "t1", "h", reward=0.0, tools=2)]
    r = compute_results(attempts, checkpoints=["a", "b"], harnesses=["h"], task_ids=["t1"], split="test")
    assert r["tool_call_reduction"] == {}
    assert r["co_solved"]["b vs a"]["cells"] == 0 and r["co_solved"]["b vs a"]["reduction"] is None


def test_paired_won_lost_and_sign_test() -> None:
    """rl solves opencode/t3 and codex/t2, which base did not (base's codex/t3 is ungraded: unsolved,
    as in pass@1), and loses none; in reverse the same cells are losses."""
    r = _results()
    d = r["paired"]["rl vs base"]
    assert (d["won"], d["lost"], d["p"]) == (2, 0, pytest.approx(0.25))
    assert d["per_harness"]["opencode"] == {"won": 1, "lost": 0, "p": pytest.approx(0.5)}
    assert d["per_harness"]["codex"]["won"] == 1
    finals = deciding_attempts(_synthetic())
    back = paired(finals["rl"], finals["base"], TASKS, HARNESSES)
    assert (back["won"], back["lost"], back["p"]) == (0, 2, 1.0)
    assert "rl vs base: won 2, lost 0, p = 0.25" in format_tables(r)


def test_metrics_and_tables() -> None:
    r = _results()
    m = eval_metrics(r, "rl")
    assert m["eval/pass_at_1"] == pytest.approx(5 / 6)
    assert m["eval/harness/codex/pass_at_1"] == pytest.approx(2 / 3)
    assert m["eval/harness/opencode/pass_at_1"] == 1.0
    assert m["eval/tool_call_reduction"] == pytest.approx(5 / 12)
    assert "eval/tool_call_reduction" not in eval_metrics(r, "base")
    text = format_tables(r)
    assert "66.7%" in text and "83.3%" in text and "41.7%" in text
    assert "rl vs base: 3 cells, baseline 8.00 -> 4.67 tool calls" in text


def test_results_json_renders_in_local_report(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    write_results(run_dir / "eval" / "results.json", _results())
    index = write_report(run_dir)
    page = index.read_text()
    assert "pass@1" in page and "rl vs base" in page and "0.417" in page
    assert "<td>0.667</td>" in page and "<td>0.833</td>" in page  # matrix cell and overall
    png = index.parent / "eval_matrix.png"
    assert png.exists() and png.stat().st_size > 5_000


# --------------------------------------------------------------------------- running cells


class ScriptedRunner:
    """Outcomes by (task, harness) in call order; records what it was asked to run."""

    def __init__(self, script: dict[tuple[str, str], list[AttemptOutcome | Exception]]) -> None:
        self.script = {k: list(v) for k, v in script.items()}
        self.calls: list[str] = []

    async def __call__(self, group: PlannedGroup, attempt_index: int, policy_version: int) -> AttemptOutcome:
        self.calls.append(group.attempt_ids[attempt_index])
        item = self.script[(group.task_id, group.harness)].pop(0)
        if isinstance(item, Exception):
            raise item
        item.attempt_id = group.attempt_ids[attempt_index]
        item.task_id, item.harness = group.task_id, group.harness
        return item


def _o(
    reward: float | None, exit_reason: str = "finished", answered: bool = True, tools: int = 1
) -> AttemptOutcome:
    return AttemptOutcome(
        attempt_id="",
        group_id="",
        task_id="",
        harness="",
        policy_version=0,
        reward=reward,
        exit_reason=exit_reason,
        tool_calls=tools,
        metrics={"answered": float(answered), "completion_tokens": 7.0},
    )


def _run(
    runner: ScriptedRunner, prior: list[EvalAttempt], sink_path: Path, retries: int = 2
) -> list[EvalAttempt]:
    from fineenvs.results import append_attempt

    return asyncio.run(
        run_cells(
            runner,
            checkpoint="ck",
            task_ids=["t1", "t2"],
            harnesses=["h"],
            prior=prior,
            infra_retries=retries,
            concurrency=2,
            sink=lambda a: append_attempt(sink_path, a),
        )
    )


def test_infra_failures_are_retried_graded_cells_are_not(tmp_path: Path) -> None:
    sink = tmp_path / "attempts.jsonl"
    runner = ScriptedRunner(
        {
            ("t1", "h"): [_o(0.0)],  # graded wrong at once: never re-run
            ("t2", "h"): [
                RuntimeError("proxy unreachable"),
                _o(0.0, "wiring_failure", answered=False),
                _o(1.0),
            ],
        }
    )
    new = _run(runner, [], sink)
    assert sorted(runner.calls) == ["t00000-h-try0", "t00001-h-try0", "t00001-h-try1", "t00001-h-try2"]
    by_task = {t: [a for a in new if a.task_id == t] for t in ("t1", "t2")}
    assert [a.try_index for a in by_task["t1"]] == [0]
    t2 = sorted(by_task["t2"], key=lambda a: a.try_index)
    assert [a.exit_reason for a in t2] == ["crashed", "wiring_failure", "finished"]
    assert "RuntimeError: proxy unreachable" in (t2[0].error or "")
    assert t2[2].solved and t2[2].completion_tokens == 7
    assert len(read_attempts(sink)) == 4  # every attempt persisted as it ended


def test_retries_stop_after_the_budget(tmp_path: Path) -> None:
    runner = ScriptedRunner(
        {
            ("t1", "h"): [_o(None)] * 2,
            ("t2", "h"): [_o(0.0, "timeout", answered=False)] * 2,
        }
    )
    new = _run(runner, [], tmp_path / "a.jsonl", retries=1)
    assert len(new) == 4 and all(a.infra_failure for a in new)
    r = compute_results(new, checkpoints=["ck"], harnesses=["h"], task_ids=["t1", "t2"], split="test")
    assert r["pass_at_1"]["ck"]["h"] == 0.0 and r["cells"]["ck"]["h"]["ungraded"] == 2


def test_resume_skips_graded_cells_and_continues_try_numbers(tmp_path: Path) -> None:
    sink = tmp_path / "attempts.jsonl"
    first = ScriptedRunner({("t1", "h"): [_o(1.0)], ("t2", "h"): [_o(None)]})
    _run(first, [], sink, retries=0)
    prior = read_attempts(sink)
    second = ScriptedRunner({("t2", "h"): [_o(0.0)]})
    new = _run(second, prior, sink, retries=0)
    assert second.calls == ["t00001-h-try1"]  # t1 graded: not re-run; t2 retried under a fresh id
    assert [(a.task_id, a.try_index) for a in new] == [("t2", 1)]
    all_attempts = read_attempts(sink)
    r = compute_results(
        all_attempts, checkpoints=["ck"], harnesses=["h"], task_ids=["t1", "t2"], split="test"
    )
    assert r["cells"]["ck"]["h"]["graded"] == 2 and r["pass_at_1"]["ck"]["h"] == 0.5
    # Nothing left: a third run starts nothing.
    third = ScriptedRunner({})
    assert _run(third, all_attempts, sink) == [] and third.calls == []


def test_bad_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(EvalError, match="eval.concurrency"):
        asyncio.run(
            run_cells(
                ScriptedRunner({}), checkpoint="c", task_ids=["t"], harnesses=["h"], prior=[],
                infra_retries=0, concurrency=0, sink=lambda a: None,
            )
        )  # fmt: skip


def test_torn_line_in_attempts_file_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "attempts.jsonl"
    good = _a("c", "t", "h", reward=1.0)
    path.write_text(json.dumps(good.__dict__) + "\n" + '{"checkpoint": "c", "task_')
    assert [a.task_id for a in read_attempts(path)] == ["t"]
