"""CLI smoke: list / show / grade / generate-demo, both option styles, and the error paths."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fineenvs.tasks.__main__ import main


def test_list_hydra_and_flag_styles(demo_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "tasks=demo", f"path={demo_dir}"]) == 0
    hydra = capsys.readouterr()
    lines = hydra.out.strip().splitlines()
    assert len(lines) == 48 and lines[0].split("\t")[0] == "demo-a-emp_any_older"
    assert "48 tasks" in hydra.err
    assert main(["list", "--tasks", "demo", "--path", str(demo_dir)]) == 0
    assert capsys.readouterr().out == hydra.out
    assert (
        main(["list", "tasks=demo", f"tasks.path={demo_dir}", "split=test", "difficulty=easy", "limit=3"])
        == 0
    )
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 3 and all("\teasy\t" in line and line.startswith("demo-c-") for line in out)


def test_show_hides_gold_unless_asked(demo_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", "demo-a-sales_orders", f"path={demo_dir}"]) == 0
    out = capsys.readouterr().out
    assert "How many orders" in out and "answer.txt" in out and "gold:" not in out
    assert main(["show", "demo-a-sales_orders", f"path={demo_dir}", "--gold"]) == 0
    assert "gold:" in capsys.readouterr().out


def test_grade_text_file_and_task_dir(
    demo_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    task_dir = demo_dir / "train" / "tasks" / "demo-a-sales_orders"
    gold = next(
        line for line in (task_dir / "task.toml").read_text().splitlines() if line.startswith("answer =")
    )
    gold = gold.split("=", 1)[1].strip().strip('"')
    assert main(["grade", "demo-a-sales_orders", gold, f"path={demo_dir}"]) == 0
    assert "score: 1.0" in capsys.readouterr().out
    answer = tmp_path / "answer.txt"
    answer.write_text(f"There are {int(gold) + 1} orders\n")
    assert main(["grade", "demo-a-sales_orders", str(answer), f"path={demo_dir}"]) == 0
    assert "score: 0.0" in capsys.readouterr().out
    assert main(["grade", str(task_dir), gold, "--score-only"]) == 0
    assert capsys.readouterr().out.strip() == "1.0"


def test_errors_exit_2_with_a_message(
    demo_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["show", "demo-a-sales_order", f"path={demo_dir}"]) == 2
    assert "did you mean demo-a-sales_orders" in capsys.readouterr().err
    assert main(["list", "tasks=nope"]) == 2
    assert "unknown task set 'nope'" in capsys.readouterr().err
    assert main(["list", "tasks=demo", f"path={demo_dir}", "split=dev"]) == 2
    assert "split='dev'" in capsys.readouterr().err
    assert main(["generate-demo", str(demo_dir)]) == 2
    assert "not empty" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2


def test_generate_demo_then_list_via_subprocess(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    assert main(["generate-demo", str(out), "--seed", "7"]) == 0
    proc = subprocess.run(
        [sys.executable, "-m", "fineenvs.tasks", "list", "tasks=demo", f"path={out}", "split=eval"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip().splitlines()) == 24 and "24 tasks" in proc.stderr
