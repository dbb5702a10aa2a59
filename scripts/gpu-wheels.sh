#!/usr/bin/env bash
# Wheels the lent GPU machine lacks for scripts/gpu-check.sh (it has torch, accelerate, tokenizers,
# safetensors, pandas, pyarrow, but neither TRL nor datasets, and an older transformers), fetched
# here for CPython 3.12 x86-64 into .whl/ (git-ignored); carry `.whl` with the check (15 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 transformers==5.24.0
ls -1 .whl
