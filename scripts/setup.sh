#!/usr/bin/env bash
# Install everything fineenvs needs into ./.venv (idempotent; a second run takes seconds).
#   scripts/setup.sh [harness ...|all|none]   harness CLIs to install (default: all)
# torch is installed first as the CPU build (torch==2.13.0) so that no dependency pulls a multi-GB
# CUDA build; set FINEENVS_TORCH_INDEX to a CPU wheel index if your pip does not find that version.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" - <<'PYEOF' || { echo "fineenvs needs Python >= 3.11 (set PYTHON=/path/to/python3.11)" >&2; exit 1; }
import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)
PYEOF
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
stamp=.venv/.fineenvs-installed
want=$(cat pyproject.toml | sha1sum | cut -c1-16)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  python -m pip install -q --upgrade pip
  if ! python -c "import torch" 2>/dev/null; then
    if [ -n "${FINEENVS_TORCH_INDEX:-}" ]; then
      python -m pip install -q torch==2.13.0 --index-url "$FINEENVS_TORCH_INDEX"
    else
      python -m pip install -q torch==2.13.0
    fi
  fi
  python -m pip install -q -e ".[dev]"
  echo "$want" > "$stamp"
fi
harnesses=("$@")
[ ${#harnesses[@]} -eq 0 ] && harnesses=(all)
if [ "${harnesses[0]}" != "none" ]; then
  python -m fineenvs.harnesses install "${harnesses[@]}"
fi
