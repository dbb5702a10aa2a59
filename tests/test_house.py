"""``scripts/house.py`` prints every measure, and its scans see what they claim to."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fineenvs.paths import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))
import house  # noqa: E402


def test_the_table_has_every_measure() -> None:
    res = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "house.py")], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr
    rows = [line for line in res.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    names = [row.split(" | ")[0].lstrip("| ") for row in rows]
    assert len(names) == 8 and names[0].startswith("files / lines") and names[-1].startswith("config errors")
    assert all(row.rstrip(" |").endswith(("yes", "no", "n/a")) for row in rows)


def test_the_scans_find_what_they_count(tmp_path: Path) -> None:
    import ast

    source = (
        "from typing import Any\n"
        "def f(x: Any, y: dict[str, Any]) -> Any:\n"
        '    """Run K showed it; runs C-E did not."""\n'
        "    return x\n"
    )
    counts = [house._any_count(a) for a, _ in house._annotations(ast.parse(source))]
    assert sum(counts) == 3
    path = tmp_path / "m.py"
    path.write_text(source)
    hits = [
        m.group(0)
        for _, text in house._docstrings_and_comments(path)
        for m in house.RUN_HISTORY.finditer(text)
    ]
    assert hits == ["Run K", "runs C-E"]
