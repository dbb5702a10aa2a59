"""The runs' JSON Lines logs: appends are whole lines, a torn last line is skipped, not fatal."""

from __future__ import annotations

from pathlib import Path

from fineenvs.jsonl import append_jsonl, read_jsonl
from fineenvs.results import sign_test_p


def test_append_then_read_round_trips_and_creates_the_folder(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "attempts.jsonl"
    append_jsonl(path, {"a": 1}, {"b": [2, 3]})
    append_jsonl(path, {"c": None})
    assert read_jsonl(path) == [{"a": 1}, {"b": [2, 3]}, {"c": None}]
    assert read_jsonl(tmp_path / "missing.jsonl") == []


def test_a_line_torn_by_a_crash_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    append_jsonl(path, {"ok": 1})
    with path.open("a") as f:
        f.write('{"cut": ')  # what a SIGKILL mid-write leaves
    assert read_jsonl(path) == [{"ok": 1}]
    append_jsonl(path, {"after": 2})  # starts a new line: not glued to the torn one and lost with it
    assert read_jsonl(path) == [{"ok": 1}, {"after": 2}]
    assert path.read_text().splitlines()[1] == '{"cut": '


def test_sign_test_matches_the_binomial_tail() -> None:
    assert sign_test_p(12, 2) == (1 + 14 + 91) / 2**14  # run C of the mini-reproduction: p = 0.006
    assert sign_test_p(0, 0) == 1.0
    assert abs(sign_test_p(5, 5) - 0.623046875) < 1e-12
