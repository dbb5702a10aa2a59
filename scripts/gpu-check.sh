#!/usr/bin/env bash
# The prepared GPU check (one GPU, under 8 minutes): GRPO steps on CUDA under bf16 autocast over
# float32 master weights, on rows the embedded engine samples on CUDA, for the three tiny models
# and one real-size (LFM2-shaped, ~1.1B parameter) configuration. Prints engine tokens/s, step time,
# trained tokens/s, peak memory (bytes per parameter) and the on-policy train/ratio per model, and
# writes them to $OUT/gpu-check.json. vLLM itself is not part of it: the GPU machine cannot install it.
#
#   scripts/gpu-wheels.sh        # here, once: wheels the GPU machine lacks, into .whl/
#   device run: scripts/gpu-check.sh   (carry .whl)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fineenvs-site .whl/*.whl \
    || { echo "gpu-check: installing the carried wheels failed" >&2; exit 2; }
  export PYTHONPATH="/tmp/fineenvs-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRL_EXPERIMENTAL_SILENCE=1
export FINEENVS_CACHE="${FINEENVS_CACHE:-/tmp/fineenvs-cache}"
nvidia-smi -L || true
"$PY" -c "import torch, transformers, trl; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), '| transformers', transformers.__version__, '| trl', trl.__version__)" || exit 2
mkdir -p "${OUT:-/tmp}"
timeout 420 "$PY" -m benchmarks gpu --device cuda --steps 3 --out "${OUT:-/tmp}/gpu-check.json"
rc=$?
echo "gpu-check: bench exit $rc"
exit $rc
