"""The files an adapter writes into an agent's fresh HOME and reads back from its logs.

Written: JSON (also for the agents that read YAML: a JSON document is valid YAML) and TOML, both
from plain dicts, so an adapter declares its config as data. Read: text, JSON lines, one JSON
document, and the typed content blocks the agents' messages carry.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from fineenvs.jsonl import JsonObject


def read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def write_json(path: Path, data: object) -> None:
    write_text(path, json.dumps(data, indent=2) + "\n")


def write_config_file(path: Path, document: JsonObject) -> None:
    """``document`` as TOML where the name ends in ``.toml``, as JSON otherwise (YAML readers take it)."""
    if path.suffix == ".toml":
        write_text(path, toml_text(document))
    else:
        write_json(path, document)


def toml_text(document: JsonObject) -> str:
    """``document`` as TOML: its plain keys, then a ``[table]`` per dict (``[a.b]`` for a dict in a
    dict) and a ``[[table]]`` per dict in a list, a blank line between the blocks."""
    blocks = [_toml_pairs(document), *_toml_tables("", document)]
    return "\n\n".join("\n".join(block) for block in blocks if block) + "\n"


def _is_table(value: object) -> bool:
    return isinstance(value, dict) or (
        isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)
    )


def _toml_pairs(table: JsonObject) -> list[str]:
    return [f"{key} = {_toml_value(value)}" for key, value in table.items() if not _is_table(value)]


def _toml_tables(prefix: str, table: JsonObject) -> list[list[str]]:
    blocks: list[list[str]] = []
    for key, value in table.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            pairs = _toml_pairs(value)
            blocks += [[f"[{name}]", *pairs]] if pairs else []
            blocks += _toml_tables(f"{name}.", value)
        elif _is_table(value):
            blocks += [[f"[[{name}]]", *_toml_pairs(item)] for item in value]
    return blocks


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, str):
        # JSON string escaping is valid TOML basic-string escaping.
        return json.dumps(value)
    raise TypeError(f"no TOML form for {value!r} ({type(value).__name__}): use a str, int, bool or list")


def iter_json_lines(text: str) -> list[JsonObject]:
    """The JSON objects among the lines of ``text`` (non-JSON lines skipped)."""
    out: list[JsonObject] = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


def json_from(text: str, opener: str) -> object:
    """The JSON document that starts at the first ``opener`` (``{`` or ``[``) in ``text`` and runs
    to its end, or None where there is none (agents print notes before it)."""
    start = text.find(opener)
    if start < 0:
        return None
    try:
        return json.loads(text[start:])
    except ValueError:
        return None


def read_json_object(path: Path) -> JsonObject | None:
    """The JSON object in ``path``; None where the file is missing, unreadable or holds no object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def typed_blocks(content: object, kind: str) -> list[JsonObject]:
    """The blocks of type ``kind`` in a message's content list (none where it is not a list)."""
    blocks: Iterable[object] = content if isinstance(content, list) else ()
    return [b for b in blocks if isinstance(b, dict) and b.get("type") == kind]


def joined_text(content: object) -> str:
    """The text blocks of a message's content list, joined."""
    return "".join(b.get("text", "") for b in typed_blocks(content, "text"))
