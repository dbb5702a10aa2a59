"""`import fineenvs.engine` stays light: no vllm, no torch (the proxy and CLI import it)."""

from __future__ import annotations

import subprocess
import sys


def test_import_pulls_in_neither_vllm_nor_torch() -> None:
    code = (
        "import sys, fineenvs.engine; "
        "print(sorted(m for m in ('vllm', 'torch', 'transformers', 'trl') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
