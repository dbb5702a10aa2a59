"""JSON Lines files: the runs' append-only logs (attempts, pairs, metrics, eval attempts).

Appends are one ``write`` of whole lines, so a crash leaves at most a torn last line; the next
append starts on a new line, readers skip a line that does not parse (with a warning), and the
attempt it described simply runs again.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, TypeAlias

log = logging.getLogger("fineenvs.jsonl")

JsonObject: TypeAlias = dict[str, Any]
"""A parsed JSON object: a line of these files, an HTTP body, a wire-format message. Its values are
untyped until the code that reads them checks them (a format's validator, a record's loader); name
real types (dataclasses, ``TypedDict``) wherever the shape is fixed, and this where it is JSON."""


def read_jsonl(path: Path) -> list[JsonObject]:
    """Every parsed line of ``path`` (none when it does not exist); unreadable lines are skipped."""
    if not path.is_file():
        return []
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as err:
            log.warning("%s:%d unreadable (%s); ignored", path, n, err)
    return out


def append_jsonl(path: Path, *records: JsonObject) -> None:
    """Append ``records`` to ``path`` (created with its folder), one line each.

    After a line torn by a crash, the first record starts a new line: it is not glued to (and lost
    with) the torn one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(r) + "\n" for r in records).encode("utf-8")
    with path.open("a+b") as f:
        if f.tell() > 0:
            f.seek(-1, 2)
            if f.read(1) != b"\n":
                data = b"\n" + data
        f.write(data)
