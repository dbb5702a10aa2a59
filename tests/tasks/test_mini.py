from __future__ import annotations

import csv
import io
import subprocess
from pathlib import Path

import pytest

from fineenvs.tasks import grade_workdir, load_tasks, materialize_inputs, mini
from fineenvs.tasks.mini import SPLIT_SIZES, generate_mini, split_specs
from fineenvs_recipes.mini_repro.teacher import solution_command

# sha256 of the 36 eval tasks as generated before the split had blocks (MINI_VERSION 2).
_FIRST_EVAL_BLOCK_SHA256 = "de4cb150b0838789aa1c865893f707c6a2457a96def7486925ac1a002b1deea6"
# sha256 of the second block of 36 as generated when the split had two blocks (2026-12-03).
_SECOND_EVAL_BLOCK_SHA256 = "8a97b93db760ee5c03cf407cd40107aabd1ceda01b7d5e4c2bfb2e138d32b891"


def _recompute(spec_csv: str, question: str) -> str:
    rows = list(csv.reader(io.StringIO(spec_csv)))
    header, data = rows[0], rows[1:]
    if question.startswith("How many"):
        return str(len(data))
    column = question.split(" column ")[0].split()[-1]
    values = [int(r[header.index(column)]) for r in data]
    return str(sum(values) if "sum" in question else max(values))


def test_splits_share_templates_but_no_files_columns_or_answers() -> None:
    specs = {split: split_specs(split) for split in SPLIT_SIZES}
    assert {s: len(v) for s, v in specs.items()} == SPLIT_SIZES
    for split, items in specs.items():
        assert {s.template for s in items} == {"rows", "sum", "max"}, split
    train, held_out = specs["train"], specs["eval"] + specs["test"]
    assert not {s.file for s in train} & {s.file for s in held_out}
    assert not {c for s in train for c in s.columns[1:]} & {c for s in held_out for c in s.columns[1:]}
    for template in ("rows", "sum", "max"):  # no held-out answer is a training answer of its template
        seen = {s.gold for s in train if s.template == template}
        assert not seen & {s.gold for s in held_out if s.template == template}, template
    for s in train + held_out:  # one value column, the one every sum/max question names
        assert len(s.columns) == 2 and s.column_index == (0 if s.template == "rows" else 2), s
        assert _recompute(s.csv_bytes().decode(), s.question) == s.gold, s.task_id


def test_generation_is_pure(tmp_path: Path) -> None:
    a, b = generate_mini(tmp_path / "a"), generate_mini(tmp_path / "b")
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files and files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)


def test_the_experts_command_solves_every_task_and_is_graded_correct(tmp_path: Path) -> None:
    """The teacher's command, run by a real shell on the task's own files, gives the gold answer,
    which the grader accepts; an answer off by one is refused (the grader really checks)."""
    root = generate_mini(tmp_path / "set")
    tasks = load_tasks("mini", split="eval", path=root)[:9]
    assert {t.metadata["template"] for t in tasks} == {"rows", "sum", "max"}
    for task in tasks:
        work = tmp_path / task.task_id
        materialize_inputs(task, work)
        command = solution_command([{"role": "user", "content": task.instruction}])
        assert command is not None, task.instruction
        subprocess.run(["bash", "-c", command], cwd=work, check=True, timeout=30)
        grade = grade_workdir(task, work)
        assert grade.score == 1.0, (task.task_id, grade)
        answer = int((work / "answer.txt").read_text())
        (work / "answer.txt").write_text(f"{answer + 1}\n")
        assert grade_workdir(task, work).score == 0.0


def test_a_split_larger_than_its_name_pools_is_refused_not_a_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(mini._BLOCKS, "eval", (72,))  # 8 stems x 6 columns cannot hold 48 sum/max tasks
    with pytest.raises(ValueError, match="cannot have 72 tasks in a block"):
        mini.split_specs("eval")


def test_the_first_eval_block_is_the_eval_split_earlier_runs_used() -> None:
    """The eval split grew from 36 tasks to 72 (a second block) and then 216 (six blocks), each
    block with pools of its own; the first 36 (what runs A-G were measured on) and the first 72 (the
    learning test's earlier runs) must not change, or those results would no longer describe the
    set. The digests are of the tasks generated before each growth."""
    import hashlib

    def digest(specs: list[mini.MiniSpec]) -> str:
        text = "\n".join(f"{s.task_id}|{s.question}|{s.gold}|{s.csv_bytes().decode()}" for s in specs)
        return hashlib.sha256(text.encode()).hexdigest()

    tasks = split_specs("eval")
    assert digest(tasks[:36]) == _FIRST_EVAL_BLOCK_SHA256
    assert digest(tasks[36:72]) == _SECOND_EVAL_BLOCK_SHA256
    assert [s.task_id for s in tasks] == [
        f"mini-eval-{i:03d}-{('rows', 'sum', 'max')[i % 3]}" for i in range(216)
    ]
    blocks = [tasks[i : i + 36] for i in range(0, 216, 36)]
    for i, a in enumerate(blocks):  # every block has files and columns of its own
        for b in blocks[i + 1 :]:
            assert not {s.file for s in a} & {s.file for s in b}
            assert not {s.columns[1] for s in a} & {s.columns[1] for s in b}
