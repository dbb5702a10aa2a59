#!/usr/bin/env bash
# A throwaway CPU environment with vLLM 0.33.0's own code, for the `vllm` test tier: vLLM's
# `vllm serve` parser checks the launcher's command line, and its pydantic protocol models and
# weight-transfer dataclasses check our request/response bodies. It cannot serve (vLLM from PyPI
# needs CUDA), and it is never the trainer's environment.
#
#   scripts/vllm-cpu-env.sh            -> prints the environment's python
#
# Cached outside the clone ($FINEENVS_CACHE, default ~/.cache/fineenvs), like the agent CLIs; a
# second run takes a second. First run: ~1.5 GB of downloads, ~3.7 GB on disk, 2-5 minutes.
# How: torch 2.13.0 CPU (the wheel on disk) first, then vllm==0.33.0 --no-deps, then vLLM's
# requirements read from its wheel's METADATA minus the CUDA-only ones, with torch held at 2.13.0.
set -euo pipefail
VERSION=0.33.0
CACHE="${FINEENVS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fineenvs}"
ENV_DIR="${FINEENVS_VLLM_CPU_ENV:-$CACHE/vllm-$VERSION-cpu}"
PY=${PYTHON:-python3}
stamp="$ENV_DIR/.fineenvs-vllm-$VERSION"
if [ -f "$stamp" ]; then
  echo "$ENV_DIR/bin/python"
  exit 0
fi
rm -rf "$ENV_DIR" "$ENV_DIR.partial"
mkdir -p "$(dirname "$ENV_DIR")"
"$PY" -m venv "$ENV_DIR.partial"
pip=("$ENV_DIR.partial/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" --upgrade pip >&2
"${pip[@]}" torch==2.13.0 >&2
"${pip[@]}" --no-deps "vllm==$VERSION" >&2
reqs="$ENV_DIR.partial/vllm-requirements.txt"
"$ENV_DIR.partial/bin/python" - "$reqs" <<'PYEOF'
import sys
from importlib.metadata import distribution

# CUDA-only wheels (or pins of a CUDA torch); the rest is what `import vllm` and its parsers need.
CUDA = ("torch", "torchaudio", "torchvision", "torchcodec", "pynvvideocodec", "flashinfer", "apache-tvm-ffi",
        "tilelang", "nvidia-", "nvtx", "fastsafetensors", "instanttensor", "quack-kernels", "tokenspeed-mla",
        "humming-kernels")
keep = []
for req in distribution("vllm").requires or []:
    if "extra ==" in req:
        continue
    name = req.split(";")[0].strip().lower()
    if not name.startswith(CUDA):
        keep.append(req)
open(sys.argv[1], "w").write("\n".join(keep) + "\n")
PYEOF
"${pip[@]}" -r "$reqs" -c <(echo "torch==2.13.0") >&2
"$ENV_DIR.partial/bin/python" -c "import vllm, vllm.entrypoints.cli.serve" >&2
mv "$ENV_DIR.partial" "$ENV_DIR"
# The venv's scripts name the .partial path in their shebangs; only bin/python is used.
echo "$VERSION" >"$stamp"
echo "$ENV_DIR/bin/python"
