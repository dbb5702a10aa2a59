"""The offline demo set: byte-identical from its seed, and every gold answer recomputed with pandas."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from fineenvs.tasks import DEMO_SEED, Task, ensure_demo, generate_demo, grade, load_tasks, materialize_inputs
from fineenvs.tasks.normalize import parse_number_exactly


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _all(demo_dir: Path) -> list[Task]:
    return [t for split in ("train", "test", "eval") for t in load_tasks("demo", split=split, path=demo_dir)]


def test_regenerates_byte_identically(demo_dir: Path, tmp_path: Path) -> None:
    again = generate_demo(tmp_path / "again", DEMO_SEED)
    first, second = _files(demo_dir), _files(again)
    assert len(first) > 400
    assert first == second
    manifest = json.loads((again / "manifest.json").read_text())
    assert manifest["seed"] == DEMO_SEED and len(manifest["files"]) == len(first) - 1


def test_other_seed_gives_other_data(demo_dir: Path, tmp_path: Path) -> None:
    other = generate_demo(tmp_path / "other", DEMO_SEED + 1)
    name = "train/tasks/demo-a-sales_orders/environment/inputs/sales.csv"
    assert (other / name).read_bytes() != (demo_dir / name).read_bytes()


def test_generate_refuses_non_empty_dir(tmp_path: Path) -> None:
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        generate_demo(tmp_path / "x")


def test_shape_of_the_set(demo_dir: Path) -> None:
    train = load_tasks("demo", split="train", path=demo_dir)
    test = load_tasks("demo", split="test", path=demo_dir)
    evals = load_tasks("demo", split="eval", path=demo_dir)
    assert (len(train), len(test), len(evals)) == (48, 24, 24)
    assert not {t.task_id for t in train} & ({t.task_id for t in test} | {t.task_id for t in evals})
    tiers = Counter(t.difficulty for t in train)
    assert tiers == {"easy": 14, "medium": 16, "hard": 18}
    types = Counter(t.hidden.answer_type for t in train)
    assert set(types) == {"number", "label", "list", "yes_no", "percentage"}
    assert {t.hidden.match_mode for t in train} >= {"auto", "list", "ordered_list", "percent"}
    assert any(t.hidden.atol > 0 for t in train) and any(t.hidden.atol == 0 for t in train)
    golds = Counter(t.hidden.gold for t in train if t.hidden.answer_type == "yes_no")
    assert set(golds) == {"yes", "no"}


def test_instructions_are_short_and_say_where_to_answer(demo_dir: Path) -> None:
    for task in _all(demo_dir):
        assert "answer.txt" in task.instruction and "working directory" in task.instruction
        assert len(task.instruction) < 400
        assert task.hidden.gold not in task.instruction.split("\n")[0] or task.hidden.answer_type == "yes_no"
        for name in task.input_files:
            assert name in task.instruction


def test_every_gold_answer_grades_as_correct_and_inputs_hold_no_answer(
    demo_dir: Path, tmp_path: Path
) -> None:
    for task in _all(demo_dir):
        assert grade(task.hidden.gold, task.hidden).score == 1.0, task.task_id
        work = tmp_path / task.task_id
        materialize_inputs(task, work)
        names = sorted(p.name for p in work.iterdir())
        assert names == sorted(task.input_files) and all(n.endswith(".csv") for n in names)


def _recompute(task: Task) -> Any:
    """The gold answer, recomputed from the task's CSV files with pandas (independent of the generator)."""
    p = json.loads(task.metadata["params"])
    tables = {name: pd.read_csv(path) for name, path in task.input_files.items()}
    name = task.metadata["template"]
    if name.startswith("sales"):
        s = tables["sales.csv"]
        s["rev"] = s["units"] * s["unit_price"]
        revenue = s.groupby("product")["rev"].sum().sort_values(ascending=False)
        by_month = s.groupby("month")["rev"].sum()
        return {
            "sales_orders": lambda: len(s),
            "sales_units": lambda: s["units"].sum(),
            "sales_top_region": lambda: s["region"].value_counts().idxmax(),
            "sales_region_revenue": lambda: s.loc[s["region"] == p.get("region"), "rev"].sum(),
            "sales_products_over": lambda: sorted(
                (u := s.groupby("product")["units"].sum())[u > p.get("threshold", 0)].index
            ),
            "sales_top3_revenue": lambda: list(revenue.index[:3]),
            "sales_month_change": lambda: (
                (by_month[p.get("m2")] - by_month[p.get("m1")]) / by_month[p.get("m1")] * 100
            ),
            "sales_category_units": lambda: (
                (m := s.merge(tables["products.csv"], on="product"))
                .loc[m["category"] == p.get("category"), "units"]
                .sum()
            ),
        }[name]()
    if name.startswith("emp"):
        e = tables["employees.csv"]
        remote = e[e["remote"] == "yes"]
        by_dept = e.groupby("department")["salary"]
        return {
            "emp_max_age": lambda: e["age"].max(),
            "emp_any_older": lambda: "yes" if (e["age"] > p.get("age")).any() else "no",
            "emp_dept_mean": lambda: e.loc[e["department"] == p.get("department"), "salary"].mean(),
            "emp_remote_pct": lambda: (e["remote"] == "yes").mean() * 100,
            "emp_top_dept": lambda: by_dept.mean().idxmax(),
            "emp_widest_dept": lambda: (by_dept.max() - by_dept.min()).idxmax(),
            "emp_remote_median": lambda: remote.loc[remote["years"] >= p.get("years"), "salary"].median(),
            "emp_remote_richer": lambda: (
                "yes" if remote["salary"].mean() > e[e["remote"] == "no"]["salary"].mean() else "no"
            ),
        }[name]()
    w = tables["weather.csv"]
    by_city = w.groupby("city")["temp_c"]
    return {
        "wx_min_temp": lambda: w["temp_c"].min(),
        "wx_hottest_city": lambda: by_city.max().idxmax(),
        "wx_city_rain": lambda: w.loc[w["city"] == p.get("city"), "rain_mm"].sum(),
        "wx_warmer": lambda: "yes" if by_city.mean()[p.get("c1")] > by_city.mean()[p.get("c2")] else "no",
        "wx_freezing_cities": lambda: sorted(by_city.min()[by_city.min() < 0].index),
        "wx_corr": lambda: w["temp_c"].corr(w["rain_mm"]),
        "wx_rainy_pct": lambda: (w.loc[w["city"] == p.get("city"), "rain_mm"] > p.get("mm")).mean() * 100,
        "wx_widest_city": lambda: (by_city.max() - by_city.min()).idxmax(),
    }[name]()


def test_every_gold_answer_is_recomputed_from_the_data(demo_dir: Path) -> None:
    tasks = _all(demo_dir)
    assert len(tasks) == 96
    for task in tasks:
        value = _recompute(task)
        gold, hidden = task.hidden.gold, task.hidden
        if hidden.answer_type in ("number", "percentage"):
            parsed = parse_number_exactly(gold)
            assert parsed is not None and parsed.percent == (hidden.answer_type == "percentage"), task.task_id
            assert abs(parsed.value - float(value)) <= max(hidden.atol, 1e-9), (task.task_id, gold, value)
        elif hidden.answer_type == "list":
            assert gold == ", ".join(value), (task.task_id, gold, value)
        else:
            assert gold == value, (task.task_id, gold, value)


def test_wrong_answers_score_zero(demo_dir: Path) -> None:
    for task in load_tasks("demo", split="test", path=demo_dir):
        assert grade("I do not know", task.hidden).score == 0.0
        if task.hidden.answer_type in ("number", "percentage"):
            parsed = parse_number_exactly(task.hidden.gold)
            assert parsed is not None
            assert grade(f"{parsed.value + 1000:.3f}", task.hidden).score == 0.0


def test_ensure_demo_generates_once_and_repairs(tmp_path: Path) -> None:
    root = tmp_path / "cache" / "demo"
    assert ensure_demo(DEMO_SEED, root) == root
    stamp = (root / "manifest.json").stat().st_mtime_ns
    assert ensure_demo(DEMO_SEED, root) == root and (root / "manifest.json").stat().st_mtime_ns == stamp
    (root / "manifest.json").unlink()  # an interrupted copy: no manifest
    ensure_demo(DEMO_SEED, root)
    assert (root / "manifest.json").is_file()
    assert not [p for p in root.parent.iterdir() if p.name.startswith(".")]  # staging cleaned up


def test_load_tasks_demo_uses_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FINEENVS_CACHE", str(tmp_path))
    tasks = load_tasks("demo", split="eval", limit=5)
    assert len(tasks) == 5
    assert str(tasks[0].input_files[next(iter(tasks[0].input_files))]).startswith(str(tmp_path))
