"""The grader ladder: every answer type and tolerance mode, plus the adversarial rules."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fineenvs.tasks import grader as grader_module
from fineenvs.tasks.grader import Grade, grade, grade_workdir
from fineenvs.tasks.model import HiddenAnswer, Task


def H(gold: str, answer_type: str = "number", **kw: object) -> HiddenAnswer:  # noqa: N802
    return HiddenAnswer(gold=gold, answer_type=answer_type, **kw)  # type: ignore[arg-type]


CASES: list[tuple[str, str, HiddenAnswer, float]] = [
    # --- numbers: exact, formatting, units, separators, explanations
    ("plain", "42", H("42"), 1.0),
    ("float zero tail", "42.000", H("42", rtol=0.0), 1.0),
    ("units", "42.5 kg", H("42.5"), 1.0),
    ("currency+thousands", "$1,234,567.50", H("1234567.5"), 1.0),
    ("thousands gold", "1234567", H("1,234,567"), 1.0),
    ("label prefix", "The answer is 17", H("17"), 1.0),
    ("final answer colon", "Final answer: 17", H("17"), 1.0),
    ("trailing explanation", "17 (counted with pandas)", H("17"), 1.0),
    ("because", "17 because there are 17 rows", H("17"), 1.0),
    ("sentence after", "17. I used df.shape to count 18 columns", H("17"), 1.0),
    ("value after colon", "Rows in sales.csv: 84", H("84"), 1.0),
    ("equals", "mean = 3.25", H("3.25"), 1.0),
    ("negative", "-7.8", H("-7.8", atol=0.01), 1.0),
    ("sign matters", "7.8", H("-7.8", atol=0.01), 0.0),
    ("negative vs positive exact", "-42", H("42"), 0.0),
    ("scientific", "1.5e3", H("1500"), 1.0),
    ("scale word", "1.2 million", H("1200000"), 1.0),
    ("fraction", "3/4", H("0.75"), 1.0),
    ("boxed", "\\boxed{12}", H("12"), 1.0),
    ("bold", "**12**", H("12"), 1.0),
    ("code fence", "```\n12\n```", H("12"), 1.0),
    ("bare label line", "Answer:\n12", H("12"), 1.0),
    ("whitespace", "  \n\t 12 \n\n", H("12"), 1.0),
    ("unicode minus", "\u22123", H("-3"), 1.0),
    # --- tolerances
    ("atol inside", "3.14", H("3.14159", atol=0.01), 1.0),
    ("atol outside", "3.12", H("3.14159", atol=0.01), 0.0),
    ("rtol inside", "1010", H("1000", rtol=0.02), 1.0),
    ("rtol outside", "1030", H("1000", rtol=0.02), 0.0),
    ("default rtol is tight", "1000.1", H("1000"), 0.0),
    ("exact mode ignores tolerance", "42.004", H("42", match_mode="exact", atol=0.01), 0.0),
    ("exact mode still reads numbers", "42.0", H("42", match_mode="exact"), 1.0),
    # --- adversarial numbers
    ("two numbers", "42 or 43", H("42"), 0.0),
    ("range", "between 40 and 45", H("42"), 0.0),
    ("candidate list on number task", "41, 42, 43", H("42"), 1.0 * 0),
    ("gold buried later", "I computed several statistics and the count is large overall\n42", H("42"), 0.0),
    (
        "gold buried in a long line",
        "The data has 12 columns and many rows; the answer might be 42",
        H("42"),
        0.0,
    ),
    ("no number", "I could not compute it", H("42"), 0.0),
    ("repeated same number", "42 = 42", H("42"), 1.0),
    # --- labels
    ("label case", "north", H("North", "label"), 1.0),
    ("label quotes", '"North"', H("North", "label"), 1.0),
    ("label explanation", "North (most rows)", H("North", "label"), 1.0),
    ("label because", "North because it has 30 orders", H("North", "label"), 1.0),
    ("label after colon", "Region: North", H("North", "label"), 1.0),
    ("label is", "The top region is North", H("North", "label"), 1.0),
    ("label hyphen/space", "new-york", H("New York", "label"), 1.0),
    ("label wrong", "South", H("North", "label"), 0.0),
    ("label hedge", "North or South", H("North", "label"), 0.0),
    ("label buried", "Looking at the counts, I think it is probably North", H("North", "label"), 0.0),
    ("label with comparison sign", ">50K", H(">50K", "label"), 1.0),
    ("label prefix only head counts", "South: North", H("South", "label"), 0.0),
    # --- lists
    ("list same order", "Apples, Bread, Cheese", H("Apples, Bread, Cheese", "list", match_mode="list"), 1.0),
    ("list permuted", "cheese, apples, bread", H("Apples, Bread, Cheese", "list", match_mode="list"), 1.0),
    ("list semicolons", "Apples; Bread; Cheese", H("Apples, Bread, Cheese", "list", match_mode="list"), 1.0),
    (
        "list brackets",
        '["Apples", "Bread", "Cheese"]',
        H("Apples, Bread, Cheese", "list", match_mode="list"),
        1.0,
    ),
    (
        "list bullets",
        "- Apples\n- Bread\n- Cheese",
        H("Apples, Bread, Cheese", "list", match_mode="list"),
        1.0,
    ),
    (
        "list oxford and",
        "Apples, Bread, and Cheese",
        H("Apples, Bread, Cheese", "list", match_mode="list"),
        1.0,
    ),
    ("list with and", "Bread and Apples", H("Apples, Bread", "list", match_mode="list"), 1.0),
    (
        "list item containing and",
        "Bread and Butter",
        H("Bread and Butter, Jam", "list", match_mode="list"),
        0.0,
    ),
    ("list missing", "Apples, Bread", H("Apples, Bread, Cheese", "list", match_mode="list"), 0.0),
    (
        "list padded",
        "Apples, Bread, Cheese, Dates",
        H("Apples, Bread, Cheese", "list", match_mode="list"),
        0.0,
    ),
    ("list wrong item", "Apples, Bread, Eggs", H("Apples, Bread, Cheese", "list", match_mode="list"), 0.0),
    ("list duplicate", "Apples, Apples, Bread", H("Apples, Bread, Cheese", "list", match_mode="list"), 0.0),
    (
        "ordered right",
        "Flour, Apples, Grapes",
        H("Flour, Apples, Grapes", "list", match_mode="ordered_list"),
        1.0,
    ),
    (
        "ordered wrong",
        "Apples, Flour, Grapes",
        H("Flour, Apples, Grapes", "list", match_mode="ordered_list"),
        0.0,
    ),
    ("numeric list tolerance", "1.001, 2", H("1, 2", "list", match_mode="list", atol=0.01), 1.0),
    ("single-item list, hedge", "Oslo, Lima", H("Oslo", "list", match_mode="list"), 0.0),
    # --- yes / no
    ("yes", "yes", H("yes", "yes_no"), 1.0),
    ("Yes.", "Yes.", H("yes", "yes_no"), 1.0),
    ("true", "True", H("yes", "yes_no"), 1.0),
    ("no with reason", "No, the mean is lower", H("no", "yes_no"), 1.0),
    ("wrong", "no", H("yes", "yes_no"), 0.0),
    ("hedge", "yes/no", H("yes", "yes_no"), 0.0),
    ("hedge words", "Yes and no", H("yes", "yes_no"), 0.0),
    ("maybe", "maybe", H("yes", "yes_no"), 0.0),
    # --- percentages
    ("percent sign", "12.5%", H("12.5%", "percentage", atol=0.1), 1.0),
    ("percent bare", "12.5", H("12.5%", "percentage", atol=0.1), 1.0),
    ("percent word", "12.5 percent", H("12.5%", "percentage", atol=0.1), 1.0),
    ("percent as fraction", "0.125", H("12.5%", "percentage", atol=0.1), 1.0),
    ("percent outside", "13%", H("12.5%", "percentage", atol=0.1), 0.0),
    ("fraction outside", "0.13", H("12.5%", "percentage", atol=0.1), 0.0),
    ("negative percent", "-3.4%", H("-3.4%", "percentage", atol=0.1), 1.0),
    ("numeric gold, percent pred", "12.5%", H("0.125", atol=0.0005), 1.0),
    ("numeric gold, percent pred same scale", "12.5%", H("12.5"), 1.0),
    ("numeric gold, bare pred is not rescaled", "12.5", H("0.125", atol=0.0005), 0.0),
    # --- symbolic
    ("sqrt vs decimal", "sqrt(2)", H("1.41421", atol=1e-4), 1.0),
    ("expr vs expr", "2*sqrt(2)", H("sqrt(8)", "free_form"), 1.0),
    ("algebra", "x + x", H("2*x", "free_form"), 1.0),
    ("pi", "pi/2", H("1.5708", atol=1e-4), 1.0),
    ("symbolic wrong", "sqrt(3)", H("sqrt(8)", "free_form"), 0.0),
    ("code is never evaluated", "__import__('os').system('false')", H("0", "free_form"), 0.0),
    ("label letter is not a constant", "2.718281828", H("E", "label"), 0.0),
    ("free form text", "Linear regression", H("linear regression", "free_form"), 1.0),
]


@pytest.mark.parametrize(("name", "prediction", "hidden", "expected"), CASES, ids=[c[0] for c in CASES])
def test_ladder(name: str, prediction: str, hidden: HiddenAnswer, expected: float) -> None:
    result = grade(prediction, hidden)
    assert result.score == expected, (name, result)
    assert result.reason


def test_rungs_are_reported() -> None:
    assert grade("42", H("42")).rung == "exact"
    assert grade("42.0 kg", H("42")).rung == "numeric"
    assert grade("0.125", H("12.5%", "percentage", atol=0.1)).rung == "percent"
    assert grade("b, a", H("a, b", "list", match_mode="list")).rung == "list"
    assert grade("sqrt(2)", H("1.41421", atol=1e-4)).rung == "symbolic"


def test_ambiguous_reason_names_the_numbers() -> None:
    result = grade("42 or 43", H("42"))
    assert result.score == 0.0 and "several numbers" in result.reason and "43" in result.reason


def test_missing_and_empty_answers_are_zero_not_none() -> None:
    assert grade(None, H("1")) == Grade(0.0, "no answer was given", "none")
    assert grade("", H("1")).score == 0.0
    assert grade("```\n```", H("1")).score == 0.0


def test_grader_crash_is_ungraded(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(line: str) -> str:
        raise RuntimeError("bug in the grader")

    monkeypatch.setattr(grader_module.nz, "answer_span", boom)
    result = grade("42", H("42"))
    assert result.score is None
    assert "bug in the grader" in result.reason and "ungraded" in result.reason


def test_power_tower_is_refused_quickly() -> None:
    start = time.monotonic()
    assert grade("9^9^9^9", H("x", "free_form")).score == 0.0
    assert time.monotonic() - start < 2.0


def test_huge_answer_is_capped() -> None:
    assert grade("42\n" + "x" * 5_000_000, H("42")).score == 1.0


@settings(max_examples=60, deadline=None)
@given(st.floats(min_value=-1e9, max_value=1e9, allow_nan=False), st.integers(min_value=0, max_value=6))
def test_rounded_gold_always_matches_and_far_values_never(value: float, decimals: int) -> None:
    gold = f"{value:.{decimals}f}"
    hidden = H(gold, atol=0.5 * 10**-decimals, rtol=0.0)
    assert grade(gold, hidden).score == 1.0
    assert grade(f"The answer is {value:,.{decimals}f} units", hidden).score == 1.0
    assert grade(f"{float(gold) + 10:.{decimals}f}", hidden).score == 0.0


def _task(tmp_path: Path, gold: str = "84") -> Task:
    return Task("t1", "Count rows. Write the answer to answer.txt.", {}, "easy", H(gold))


def test_grade_workdir_reads_answer_file(tmp_path: Path) -> None:
    (tmp_path / "answer.txt").write_text("84\n")
    assert grade_workdir(_task(tmp_path), tmp_path).score == 1.0
    (tmp_path / "answer.txt").write_text("85\n")
    assert grade_workdir(_task(tmp_path), tmp_path).score == 0.0


def test_grade_workdir_missing_file_is_zero(tmp_path: Path) -> None:
    result = grade_workdir(_task(tmp_path), tmp_path)
    assert result.score == 0.0 and "no answer.txt" in result.reason


def test_grade_workdir_refuses_symlink(tmp_path: Path) -> None:
    secret = tmp_path / "elsewhere.txt"
    secret.write_text("84")
    work = tmp_path / "work"
    work.mkdir()
    (work / "answer.txt").symlink_to(secret)
    result = grade_workdir(_task(tmp_path), work)
    assert result.score == 0.0 and "symbolic link" in result.reason


def test_grade_workdir_directory_and_binary(tmp_path: Path) -> None:
    (tmp_path / "answer.txt").mkdir()
    assert grade_workdir(_task(tmp_path), tmp_path).score == 0.0
    other = tmp_path / "b"
    other.mkdir()
    (other / "answer.txt").write_bytes(b"\xff\xfe\x00 garbage")
    result = grade_workdir(_task(tmp_path), other)  # undecodable bytes are replaced, never a crash
    assert result.score == 0.0 and result.rung != "error"


def test_grade_workdir_unreadable_is_ungraded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "answer.txt").write_text("84")

    def fail(self: Path, *args: object, **kwargs: object) -> object:
        raise PermissionError("denied")

    monkeypatch.setattr(Path, "open", fail)
    result = grade_workdir(_task(tmp_path), tmp_path)
    assert result.score is None and "denied" in result.reason
