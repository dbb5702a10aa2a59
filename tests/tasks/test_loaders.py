"""Loaders: Harbor and row layouts round trip, splits, filters, the training subset, the Hub failure."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fineenvs.tasks import (
    HiddenAnswer,
    Task,
    TaskError,
    TaskFilter,
    TaskSetUnavailableError,
    TrainingSubset,
    grade_workdir,
    load_tasks,
    materialize_inputs,
    training_subset,
)
from fineenvs.tasks import smoldataenvs as sde
from fineenvs.tasks.harbor import read_harbor_task, write_harbor_task

CSV = b"a,b\n1,2\n3,4\n"


def _meta(task_id: str, **extra: object) -> dict[str, object]:
    meta: dict[str, object] = {
        "task_id": task_id,
        "difficulty_tier": "medium",
        "question": "What is the sum of column a?",
        "answer": "4",
        "answer_type": "number",
        "reward_mode": "numeric",
        "atol": 0.5,
        "rtol": 0.0,
        "files": ["data.csv"],
    }
    meta.update(extra)
    return meta


def _write_harbor(root: Path, n: int = 3) -> None:
    for i in range(n):
        write_harbor_task(
            root,
            task_id=f"h{i}",
            instruction=f"Task {i}: sum column a of data.csv. Write the answer to answer.txt.",
            metadata=_meta(f"h{i}", difficulty_tier=("easy", "medium", "hard")[i % 3]),
            inputs={"data.csv": CSV},
        )


def test_harbor_round_trip(tmp_path: Path) -> None:
    _write_harbor(tmp_path / "train")
    tasks = load_tasks("smoldataenvs", split="train", path=tmp_path)
    assert [t.task_id for t in tasks] == ["h0", "h1", "h2"]
    task = tasks[1]
    assert task.difficulty == "medium"
    assert task.hidden == HiddenAnswer("4", "number", "numeric", 0.5, 0.0)
    assert task.instruction.startswith("Task 1: sum column a")
    assert set(task.input_files) == {"data.csv"} and task.input_files["data.csv"].read_bytes() == CSV
    assert task.metadata["source"] == "harbor" and task.metadata["split"] == "train"
    assert "answer" not in task.metadata  # the gold answer lives only in `hidden`
    task_dir = tmp_path / "train" / "tasks" / "h1"
    assert (task_dir / "tests" / "test.sh").is_file() and (task_dir / "environment" / "Dockerfile").is_file()


def test_harbor_dir_without_split_subdir(tmp_path: Path) -> None:
    _write_harbor(tmp_path)
    assert len(load_tasks("smoldataenvs", split="test", path=tmp_path)) == 3


def test_upstream_harbor_task_is_adapted(tmp_path: Path) -> None:
    task_dir = tmp_path / "tasks" / "up-1"
    (task_dir / "environment" / "setup_files" / "inputs").mkdir(parents=True)
    (task_dir / "environment" / "setup_files" / "inputs" / "titanic.csv").write_bytes(CSV)
    (task_dir / "tests").mkdir()
    (task_dir / "tests" / "expected_answer.txt").write_text("0.38\n")
    (task_dir / "task.toml").write_text(
        'version = "1.0"\n[metadata]\ndifficulty_level = 4\nreward_mode = "exact"\natol = 0.01\n'
    )
    (task_dir / "instruction.md").write_text(
        "What share survived? The data is in /home/user/input/titanic.csv. Write it to /workdir/answer.txt."
    )
    task = read_harbor_task(task_dir)
    assert task.task_id == "up-1" and task.difficulty == "hard"
    assert task.hidden.gold == "0.38" and task.hidden.answer_type == "number"
    assert (
        task.hidden.match_mode == "numeric" and task.hidden.atol == 0.01
    )  # upstream "exact" keeps tolerance
    assert "/home/user/input" not in task.instruction and "titanic.csv" in task.instruction
    assert "Write it to answer.txt" in task.instruction and task.metadata["instruction_rewritten"]
    assert set(task.input_files) == {"titanic.csv"}


def test_harbor_errors_are_specific(tmp_path: Path) -> None:
    task_dir = tmp_path / "tasks" / "bad"
    task_dir.mkdir(parents=True)
    (task_dir / "task.toml").write_text('[metadata]\ndifficulty_tier = "medium"\n')
    (task_dir / "instruction.md").write_text("q")
    with pytest.raises(TaskError, match="no gold answer"):
        read_harbor_task(task_dir)
    (task_dir / "task.toml").write_text('[metadata]\nanswer = "1"\n')
    with pytest.raises(TaskError, match="no difficulty"):
        read_harbor_task(task_dir)
    (task_dir / "task.toml").write_text("[metadata\n")
    with pytest.raises(TaskError, match="cannot read"):
        read_harbor_task(task_dir)


def _rows(n: int = 4) -> list[dict[str, object]]:
    return [
        {
            "task_id": f"r{i}",
            "question": f"Question {i}?",
            "answer": ["12.5", "Oslo", "a, b", "yes"][i % 4],
            "reward_mode": ["numeric", "exact", "list", "exact"][i % 4],
            "atol": 0.1,
            "rtol": 0.0,
            "files": ["data.csv"],
            "bucket_prefix": f"bucket/ds{i}",
            "difficulty_tier": ["easy", "medium", "hard", "hard"][i % 4],
        }
        for i in range(n)
    ]


def test_rows_jsonl_round_trip(tmp_path: Path) -> None:
    rows = _rows()
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "files" / "bucket" / "ds0").mkdir(parents=True)
    (tmp_path / "files" / "bucket" / "ds0" / "data.csv").write_bytes(CSV)
    (tmp_path / "files" / "r1").mkdir(parents=True)
    (tmp_path / "files" / "r1" / "data.csv").write_bytes(CSV)
    tasks = load_tasks("smoldataenvs", split="test", path=tmp_path)
    assert [t.task_id for t in tasks] == ["r0", "r1", "r2", "r3"]
    assert [t.hidden.answer_type for t in tasks] == ["number", "label", "list", "yes_no"]
    assert [t.hidden.match_mode for t in tasks] == ["numeric", "exact", "list", "exact"]
    assert [t.difficulty for t in tasks] == ["easy", "medium", "hard", "hard"]
    assert tasks[0].input_files["data.csv"].read_bytes() == CSV and tasks[1].input_files
    assert tasks[2].input_files == {} and tasks[2].metadata["missing_inputs"] == ["data.csv"]
    assert "Question 2?" in tasks[2].instruction and "answer.txt" in tasks[2].instruction
    assert "data.csv" in tasks[2].instruction
    kept = load_tasks("smoldataenvs", split="test", path=tmp_path, filters=TaskFilter(require_inputs=True))
    assert [t.task_id for t in kept] == ["r0", "r1"]


def test_rows_parquet_hf_naming(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    pq.write_table(pa.Table.from_pylist(_rows(8)), tmp_path / "data" / "eval-00000-of-00001.parquet")
    tasks = load_tasks("smoldataenvs", split="eval", path=tmp_path, layout="rows")
    assert len(tasks) == 8 and tasks[5].hidden.gold == "Oslo"


def test_rows_missing_keys_and_bad_values(tmp_path: Path) -> None:
    (tmp_path / "train.jsonl").write_text(json.dumps({"task_id": "x", "answer": "1"}) + "\n")
    with pytest.raises(TaskError, match="lacks \\['question'\\]"):
        load_tasks("smoldataenvs", path=tmp_path)
    (tmp_path / "train.jsonl").write_text("{not json\n")
    with pytest.raises(TaskError, match="train.jsonl:1"):
        load_tasks("smoldataenvs", path=tmp_path)
    row = _rows(1)[0] | {"atol": "wide"}
    (tmp_path / "train.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(TaskError, match="atol='wide'"):
        load_tasks("smoldataenvs", path=tmp_path)


def test_missing_split_and_bad_arguments(tmp_path: Path) -> None:
    (tmp_path / "train.jsonl").write_text(json.dumps(_rows(1)[0]) + "\n")
    with pytest.raises(TaskError, match="no 'test' tasks found"):
        load_tasks("smoldataenvs", split="test", path=tmp_path)
    with pytest.raises(TaskError, match="split='dev'"):
        load_tasks("smoldataenvs", split="dev", path=tmp_path)
    with pytest.raises(TaskError, match="unknown task set"):
        load_tasks("kaggle", path=tmp_path)
    with pytest.raises(TaskError, match="limit"):
        load_tasks("smoldataenvs", path=tmp_path, limit=-1)
    with pytest.raises(TaskError, match="not a directory"):
        load_tasks("smoldataenvs", path=tmp_path / "nope")
    with pytest.raises(TaskError, match="difficulty"):
        TaskFilter(difficulties=("extreme",))


def test_filters_and_limit(tmp_path: Path) -> None:
    _write_harbor(tmp_path, n=6)
    hard = load_tasks("smoldataenvs", path=tmp_path, filters=TaskFilter(difficulties=("hard",)))
    assert [t.task_id for t in hard] == ["h2", "h5"]
    some = load_tasks("smoldataenvs", path=tmp_path, filters=TaskFilter(exclude_task_ids=("h0",)), limit=2)
    assert [t.task_id for t in some] == ["h1", "h2"]
    only = load_tasks(
        "smoldataenvs", path=tmp_path, filters=TaskFilter(task_ids=("h4",), answer_types=("number",))
    )
    assert [t.task_id for t in only] == ["h4"]


def test_materialize_copies_inputs_only(tmp_path: Path) -> None:
    _write_harbor(tmp_path / "set", n=1)
    task = load_tasks("smoldataenvs", path=tmp_path / "set")[0]
    work = tmp_path / "work"
    written = materialize_inputs(task, work)
    assert written == [work / "data.csv"]
    assert sorted(p.name for p in work.rglob("*")) == ["data.csv"]
    assert not any(task.hidden.gold in p.read_text() and p.name != "data.csv" for p in work.rglob("*"))
    (work / "answer.txt").write_text("4.2")
    assert grade_workdir(task, work).score == 1.0


@pytest.mark.parametrize("name", ["../escape.csv", "/etc/passwd", "answer.txt", ""])
def test_input_names_are_checked(name: str) -> None:
    with pytest.raises(TaskError):
        Task("t", "i", {name: Path("x")}, "easy", HiddenAnswer("1"))


def test_materialize_missing_source_is_an_error(tmp_path: Path) -> None:
    task = Task("t", "i", {"data.csv": tmp_path / "gone.csv"}, "easy", HiddenAnswer("1"))
    with pytest.raises(TaskError, match="missing"):
        materialize_inputs(task, tmp_path / "w")


def test_hidden_answer_stays_out_of_repr() -> None:
    task = Task("t", "i", {}, "easy", HiddenAnswer("secret-42"))
    assert "secret-42" not in repr(task) and "secret-42" not in repr(task.hidden)


def _pool(n_easy: int, n_medium: int, n_hard: int) -> list[Task]:
    tiers = ["easy"] * n_easy + ["medium"] * n_medium + ["hard"] * n_hard
    return [Task(f"task-{i:05d}", "i", {}, tier, HiddenAnswer("1")) for i, tier in enumerate(tiers)]


def test_training_subset_counts_and_fixed_order() -> None:
    pool = _pool(300, 500, 700)
    subset = training_subset(pool)
    assert len(subset) == 1000
    assert sum(t.difficulty == "medium" for t in subset) == 400
    assert sum(t.difficulty == "hard" for t in subset) == 600
    shuffled = pool[:]
    random.Random(7).shuffle(shuffled)
    assert [t.task_id for t in training_subset(shuffled)] == [t.task_id for t in subset]
    # the order is interleaved by hash, not tier blocks, and not the input order
    assert {t.difficulty for t in subset[:50]} == {"medium", "hard"}
    assert [t.task_id for t in subset] != sorted(t.task_id for t in subset)


def test_training_subset_pool_too_small() -> None:
    with pytest.raises(TaskError, match="needs 600 hard tasks but the pool has 599"):
        training_subset(_pool(0, 400, 599))


def test_hub_failure_is_a_clear_message(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    def offline(**kwargs: object) -> str:
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(TaskSetUnavailableError) as info:
        load_tasks("smoldataenvs", split="test", revision="abc123")
    text = str(info.value)
    assert "FineEnvs/SmolDataEnvs-harbor-test" in text and "abc123" in text
    assert "tasks.path=DIR" in text and "tasks=demo" in text and "Name or service not known" in text


def test_hub_rows_path_with_fake_datasets(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    calls: list[tuple[str, str, str | None]] = []

    def fake_load_dataset(repo: str, split: str, revision: str | None = None) -> list[dict[str, object]]:
        calls.append((repo, split, revision))
        return _rows(4)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    tasks = load_tasks("smoldataenvs", split="eval", revision="deadbeef", layout="rows")
    assert calls == [("FineEnvs/SmolDataEnvs", "eval", "deadbeef")]
    assert len(tasks) == 4 and tasks[0].metadata["source_revision"] == "deadbeef"
    assert tasks[0].metadata["inputs_local"] is False


def test_hub_offline_env_message_via_cli(tmp_path: Path) -> None:
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-m", "fineenvs.tasks", "list", "tasks=smoldataenvs", "split=eval"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "could not fetch SmolDataEnvs" in proc.stderr and "tasks=demo" in proc.stderr


def test_pinned_revisions_table_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, object] = {}

    def fake_snapshot(**kwargs: object) -> str:
        seen.update(kwargs)
        raise OSError("offline")

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    monkeypatch.setitem(sde.PINNED_REVISIONS, sde.HARBOR_REPOS["train"], "f" * 40)
    with pytest.raises(TaskSetUnavailableError):
        load_tasks("smoldataenvs", split="train")
    assert seen["revision"] == "f" * 40 and seen["repo_type"] == "dataset"


def test_load_tasks_subset_option(tmp_path: Path) -> None:
    rows = [
        {"task_id": f"s{i:04d}", "question": "q", "answer": "1", "difficulty_tier": tier}
        for i, tier in enumerate(["easy"] * 50 + ["medium"] * 450 + ["hard"] * 650)
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    from fineenvs.tasks.__main__ import _named_subset

    published = _named_subset("smoldataenvs", "published_1000")  # conf/tasks/smoldataenvs.yaml
    assert published == TrainingSubset("published_1000", easy=0, medium=400, hard=600)
    tasks = load_tasks("smoldataenvs", path=tmp_path, subset=published)
    assert len(tasks) == 1000 and [t.task_id for t in tasks] == [t.task_id for t in training_subset(tasks)]
    assert Counter(t.difficulty for t in tasks) == {"medium": 400, "hard": 600}
    with pytest.raises(TaskError, match="needs split='train'"):
        load_tasks("smoldataenvs", path=tmp_path, split="test", subset=published)
    with pytest.raises(TaskError, match="unknown subset 'all' of the smoldataenvs tasks"):
        _named_subset("smoldataenvs", "all")
    with pytest.raises(TaskError, match="needs 400 medium tasks but the pool has 16"):
        load_tasks("demo", subset=published, path=_demo(tmp_path))


def _demo(tmp_path: Path) -> Path:
    from fineenvs.tasks import generate_demo

    return generate_demo(tmp_path / "demo")
