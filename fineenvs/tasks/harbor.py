"""Harbor task layout: read a directory of tasks, write one task.

Layout (one directory per split)::

    <root>/tasks/<task_id>/task.toml       metadata: difficulty, question, gold answer, tolerances
    <root>/tasks/<task_id>/instruction.md  what the agent is told
    <root>/tasks/<task_id>/environment/    Dockerfile; input files under environment/inputs/
    <root>/tasks/<task_id>/tests/          verifier (test.sh); never copied into the sandbox

SmolDataEnvs' Harbor repos keep inputs in a bucket pulled by the container (``bucket_prefix``) or,
in a later revision, under ``setup_files/inputs``; both are recognised. Upstream instructions say
inputs are in ``/home/user/input/`` and the answer goes to ``/workdir/answer.txt``; our sandboxes
put both in the agent's working directory, so those paths are rewritten (and recorded in metadata).
"""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path
from typing import Any

from fineenvs.jsonl import JsonObject
from fineenvs.tasks.model import ANSWER_FILE, HiddenAnswer, Task, TaskError
from fineenvs.tasks.row_layout import answer_type_for, difficulty_for, match_mode_for

INPUT_DIRS = ("environment/inputs", "environment/setup_files/inputs", "setup_files/inputs")
GOLD_KEYS = ("answer", "gold_answer", "expected_answer", "gold")
ANSWER_NOTE = f"Write your final answer to {ANSWER_FILE} in your working directory."


def find_task_dirs(root: Path) -> list[Path]:
    """Task directories under `root` (``root/tasks/*`` or ``root/*``), sorted by name."""
    base = root / "tasks" if (root / "tasks").is_dir() else root
    return sorted(p for p in base.iterdir() if (p / "task.toml").is_file()) if base.is_dir() else []


def is_harbor_dir(root: Path) -> bool:
    return bool(find_task_dirs(root))


def read_harbor_dir(root: Path, *, split: str | None = None) -> list[Task]:
    """All tasks of a Harbor-layout directory, sorted by task id."""
    dirs = find_task_dirs(root)
    if not dirs:
        raise TaskError(
            f"{root} holds no Harbor tasks: expected {root}/tasks/<task_id>/task.toml "
            "(with instruction.md, environment/, tests/ beside it)"
        )
    return [read_harbor_task(d, split=split) for d in dirs]


def read_harbor_task(task_dir: Path, *, split: str | None = None) -> Task:
    """One task directory -> `Task`. Errors name the file and the missing key."""
    toml_path = task_dir / "task.toml"
    try:
        data = tomllib.loads(toml_path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise TaskError(f"cannot read {toml_path}: {exc}") from exc
    meta: JsonObject = dict(data.get("metadata", {}))
    task_id = str(meta.get("task_id") or task_dir.name)
    gold = _gold_answer(task_dir, data, meta)
    reward_mode = str(meta.get("reward_mode") or meta.get("match_mode") or "")
    answer_type = answer_type_for(meta.get("answer_type"), reward_mode, gold)
    hidden = HiddenAnswer(
        gold=gold,
        answer_type=answer_type,
        match_mode=match_mode_for(reward_mode, answer_type),
        atol=_tolerance(meta, "atol", "abs_tol", 0.0, toml_path),
        rtol=_tolerance(meta, "rtol", "rel_tol", 1e-6, toml_path),
    )
    instruction_path = task_dir / "instruction.md"
    if instruction_path.is_file():
        instruction, rewritten = adapt_instruction(instruction_path.read_text(encoding="utf-8"))
    elif meta.get("question"):
        instruction, rewritten = str(meta["question"]) + "\n\n" + ANSWER_NOTE, True
    else:
        raise TaskError(f"task {task_id}: no instruction.md in {task_dir} and no metadata.question")
    inputs = _input_files(task_dir)
    extra = {k: v for k, v in meta.items() if k not in GOLD_KEYS}
    extra.update(
        source="harbor",
        task_dir=str(task_dir),
        split=split,
        reward_mode=reward_mode or None,
        instruction_rewritten=rewritten,
        inputs_local=bool(inputs) or not meta.get("files"),
    )
    return Task(
        task_id=task_id,
        instruction=instruction,
        input_files=inputs,
        difficulty=difficulty_for(meta, task_id),
        hidden=hidden,
        metadata=extra,
        environment=env_dir
        if (env_dir := task_dir / "environment").joinpath("Dockerfile").is_file()
        else None,
    )


def adapt_instruction(text: str) -> tuple[str, bool]:
    """Point upstream's absolute sandbox paths at the working directory; returns (text, changed)."""
    original = text
    text = text.replace("/workdir/answer.txt", ANSWER_FILE)
    text = text.replace("/home/user/input/", "").replace("/home/user/input", "your working directory")
    if ANSWER_FILE not in text:
        text = text.rstrip() + "\n\n" + ANSWER_NOTE + "\n"
    return text, text != original


def write_harbor_task(
    root: Path,
    *,
    task_id: str,
    instruction: str,
    metadata: JsonObject,
    inputs: dict[str, bytes],
) -> Path:
    """Write one task in the Harbor layout under ``root/tasks/<task_id>``; returns its directory."""
    task_dir = root / "tasks" / task_id
    (task_dir / "environment" / "inputs").mkdir(parents=True, exist_ok=True)
    (task_dir / "tests").mkdir(parents=True, exist_ok=True)
    document = {
        "version": "1.0",
        "metadata": metadata,
        "verifier": {"timeout_sec": 60.0},
        "agent": {"timeout_sec": 600.0},
    }
    (task_dir / "task.toml").write_text(dumps_toml(document), encoding="utf-8")
    (task_dir / "instruction.md").write_text(instruction, encoding="utf-8")
    for name, content in sorted(inputs.items()):
        (task_dir / "environment" / "inputs" / name).write_bytes(content)
    (task_dir / "environment" / "Dockerfile").write_text(
        "FROM python:3.11-slim\nRUN pip install --no-cache-dir pandas\nWORKDIR /workdir\nCOPY inputs/ /workdir/\n",
        encoding="utf-8",
    )
    (task_dir / "tests" / "test.sh").write_text(
        "#!/bin/sh\n"
        "# Grade /workdir/answer.txt against task.toml with fineenvs' grader (needs fineenvs installed).\n"
        "# No answer file is a reward of 0.0, and the script still exits cleanly.\n"
        "mkdir -p /logs/verifier\n"
        "if [ ! -f /workdir/answer.txt ]; then echo 0.0 > /logs/verifier/reward.txt; exit 0; fi\n"
        'python3 -m fineenvs.tasks grade "$(dirname "$0")/.." /workdir/answer.txt --score-only '
        "> /logs/verifier/reward.txt || echo 0.0 > /logs/verifier/reward.txt\n",
        encoding="utf-8",
    )
    return task_dir


def dumps_toml(document: JsonObject) -> str:
    """Serialise the small subset of TOML we write (scalars, lists, one level of tables)."""
    lines: list[str] = []
    tables = [(k, v) for k, v in document.items() if isinstance(v, dict)]
    for key, value in document.items():
        if not isinstance(value, dict):
            lines.append(f"{key} = {_toml_value(value)}")
    for name, table in tables:
        lines.append("")
        lines.append(f"[{name}]")
        for key, value in table.items():
            if isinstance(value, dict):
                raise TaskError(f"dumps_toml: nested table {name}.{key} is not supported")
            lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            raise TaskError(f"dumps_toml: {value} is not a valid task value")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TaskError(f"dumps_toml: cannot write {type(value).__name__} {value!r}")


def _gold_answer(task_dir: Path, data: JsonObject, meta: JsonObject) -> str:
    for table in (meta, data.get("grading", {}), data):
        for key in GOLD_KEYS:
            if isinstance(table, dict) and table.get(key) not in (None, ""):
                return str(table[key])
    for name in ("expected_answer.txt", "answer.txt", "gold.txt"):
        path = task_dir / "tests" / name
        if path.is_file():
            return path.read_text(encoding="utf-8").strip()
    raise TaskError(
        f"task {task_dir.name}: no gold answer; looked for metadata.{{{','.join(GOLD_KEYS)}}} and "
        f"grading.answer in {task_dir / 'task.toml'} and for tests/expected_answer.txt"
    )


def _tolerance(meta: JsonObject, key: str, alias: str, default: float, where: Path) -> float:
    value = meta.get(key, meta.get(alias))
    if value is None or value == "":
        return default
    try:
        return float(value)
    except (TypeError, ValueError) as exc:
        raise TaskError(f"{where}: metadata.{key}={value!r} is not a number") from exc


def _input_files(task_dir: Path) -> dict[str, Path]:
    files: dict[str, Path] = {}
    for sub in INPUT_DIRS:
        base = task_dir / sub
        if base.is_dir():
            for path in sorted(base.rglob("*")):
                if path.is_file():
                    files.setdefault(path.relative_to(base).as_posix(), path)
    return files
