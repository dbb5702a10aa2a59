"""The flat row layout of SmolDataEnvs and the field mappings shared with the Harbor reader.

A row: ``task_id``, ``question``, ``answer``, ``reward_mode``, ``atol``, ``rtol``, ``files`` (file
names), optionally ``bucket_prefix``, ``difficulty_tier`` / ``difficulty_level``, ``answer_type``.
A local rows dataset is a directory with ``<split>.jsonl`` (or ``.json``, ``.parquet``, or HF's
``data/<split>-*.parquet``) and, optionally, the input files under
``files/<task_id>/`` or ``files/<bucket_prefix>/``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from fineenvs.jsonl import JsonObject
from fineenvs.tasks.model import (
    ANSWER_FILE,
    ANSWER_TYPES,
    DIFFICULTIES,
    MATCH_MODES,
    HiddenAnswer,
    Task,
    TaskError,
)
from fineenvs.tasks.normalize import NO_WORDS, YES_WORDS, normalize_text, parse_number_exactly

REQUIRED_ROW_KEYS = ("task_id", "question", "answer")

_TYPE_ALIASES = {
    "numeric": "number",
    "num": "number",
    "float": "number",
    "int": "number",
    "short_label": "label",
    "string": "label",
    "str": "label",
    "text": "label",
    "csv-list": "csv_list",
    "yes/no": "yes_no",
    "yesno": "yes_no",
    "boolean": "yes_no",
    "bool": "yes_no",
    "free-form": "free_form",
    "freeform": "free_form",
    "percent": "percentage",
}
_MODE_ALIASES = {
    "csv_list": "list",
    "csv-list": "list",
    "set": "list",
    "ordered": "ordered_list",
    "percentage": "percent",
    "math": "symbolic",
    "sympy": "symbolic",
    "math_verify": "symbolic",
    "yes/no": "yes_no",
    "number": "numeric",
}

FORMAT_HINTS = {
    "number": "a single number",
    "percentage": "a percentage such as 12.5%",
    "list": "the items separated by commas",
    "csv_list": "the items separated by commas",
    "yes_no": "yes or no",
    "label": "just the value, no explanation",
    "free_form": "just the answer, no explanation",
}


def answer_type_for(explicit: Any, reward_mode: str, gold: str) -> str:
    """The answer type from an explicit field, else the reward mode, else the gold answer's shape."""
    for raw in (explicit, reward_mode):
        if raw:
            name = str(raw).strip().lower()
            name = _TYPE_ALIASES.get(name, name)
            if name in ANSWER_TYPES:
                return name
    key = normalize_text(gold)
    if key in YES_WORDS | NO_WORDS:
        return "yes_no"
    number = parse_number_exactly(gold)
    if number is not None:
        return "percentage" if number.percent else "number"
    return "label"


def match_mode_for(reward_mode: str, answer_type: str) -> str:
    """Our match mode for an upstream reward mode; unknown modes run the whole ladder ("auto")."""
    mode = _MODE_ALIASES.get(reward_mode.strip().lower(), reward_mode.strip().lower())
    if mode == "exact" and answer_type in ("number", "percentage"):
        return "numeric"  # upstream "exact" numbers still honour their tolerances
    if mode in ("list",) and answer_type not in ("list", "csv_list"):
        return "auto"
    return mode if mode in MATCH_MODES else "auto"


def difficulty_for(meta: Mapping[str, Any], task_id: str) -> str:
    """Tier from ``difficulty_tier`` / ``difficulty``, else from ``difficulty_level`` 1-5.

    Level mapping (ours; upstream publishes tiers, not this mapping): 1-2 easy, 3 medium, 4-5 hard.
    """
    for key in ("difficulty_tier", "difficulty", "tier"):
        value = meta.get(key)
        if isinstance(value, str) and value.strip().lower() in DIFFICULTIES:
            return value.strip().lower()
    level = meta.get("difficulty_level")
    if isinstance(level, int | float) and not isinstance(level, bool) and 1 <= level <= 5:
        return "easy" if level <= 2 else "medium" if level <= 3 else "hard"
    raise TaskError(
        f"task {task_id}: no difficulty; set metadata.difficulty_tier to one of {DIFFICULTIES} "
        "(or difficulty_level 1-5)"
    )


def build_instruction(question: str, files: Iterable[str], answer_type: str) -> str:
    """The standard short instruction: question, the files, where and how to answer."""
    names = ", ".join(files)
    where = f"Data files in your working directory: {names}.\n" if names else ""
    hint = FORMAT_HINTS.get(answer_type, "just the answer")
    return f"{question.strip()}\n\n{where}Write only the final answer ({hint}) to {ANSWER_FILE} in your working directory.\n"


def task_from_row(row: Mapping[str, Any], *, files_root: Path | None, split: str | None, source: str) -> Task:
    """One flat row -> `Task`; input files are looked up under `files_root` when given."""
    missing = [k for k in REQUIRED_ROW_KEYS if row.get(k) in (None, "")]
    if missing:
        raise TaskError(
            f"row {row.get('task_id', '<no task_id>')!r} lacks {missing}; a SmolDataEnvs row needs "
            f"{REQUIRED_ROW_KEYS} (plus reward_mode, atol, rtol, files)"
        )
    task_id, gold = str(row["task_id"]), str(row["answer"])
    reward_mode = str(row.get("reward_mode") or "")
    answer_type = answer_type_for(row.get("answer_type"), reward_mode, gold)
    files = [str(f) for f in (row.get("files") or [])]
    hidden = HiddenAnswer(
        gold=gold,
        answer_type=answer_type,
        match_mode=match_mode_for(reward_mode, answer_type),
        atol=_float(row.get("atol"), 0.0, task_id, "atol"),
        rtol=_float(row.get("rtol"), 1e-6, task_id, "rtol"),
    )
    inputs: dict[str, Path] = {}
    not_found: list[str] = []
    prefix = str(row.get("bucket_prefix") or "")
    for name in files:
        found = _find_input(files_root, name, [task_id, prefix]) if files_root else None
        if found is None:
            not_found.append(name)
        else:
            inputs[name] = found
    metadata = {k: v for k, v in row.items() if k not in ("answer", "question")}
    metadata.update(
        source=source,
        split=split,
        question=str(row["question"]),
        reward_mode=reward_mode or None,
        missing_inputs=not_found,
        inputs_local=not not_found,
    )
    return Task(
        task_id=task_id,
        instruction=build_instruction(str(row["question"]), files, answer_type),
        input_files=inputs,
        difficulty=difficulty_for(row, task_id),
        hidden=hidden,
        metadata=metadata,
    )


def find_rows_file(root: Path, split: str) -> list[Path]:
    """The file(s) holding `split` in a local rows dataset; empty when there are none."""
    for candidate in (root / f"{split}.jsonl", root / f"{split}.json", root / f"{split}.parquet"):
        if candidate.is_file():
            return [candidate]
    return sorted((root / "data").glob(f"{split}-*.parquet")) + sorted((root / "data").glob(f"{split}.jsonl"))


def read_rows(paths: list[Path]) -> list[JsonObject]:
    rows: list[JsonObject] = []
    for path in paths:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            rows.extend(pq.read_table(path).to_pylist())
        elif path.suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8"))
            rows.extend(data if isinstance(data, list) else data.get("rows", []))
        else:
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise TaskError(f"{path}:{number}: not a JSON row: {exc}") from exc
    return rows


def _find_input(files_root: Path, name: str, dirs: list[str]) -> Path | None:
    for path in [files_root / sub / name for sub in dirs if sub] + [files_root / name]:
        if path.is_file():
            return path
    return None


def _float(value: Any, default: float, task_id: str, key: str) -> float:
    if value is None or value == "":
        return default
    try:
        return float(value)
    except (TypeError, ValueError) as exc:
        raise TaskError(f"task {task_id}: {key}={value!r} is not a number") from exc
