#!/usr/bin/env bash
# CUDA readiness, for the first run on a GPU machine (about 5 minutes on one GPU):
#   bash benchmarks/device_check.sh            # after scripts/setup.sh (or any venv with the project)
# 1. the CUDA tests (tests/hf/test_cuda.py: exact reuse equals uncached on the device, the
#    device tier in accelerator memory with a pinned host tier, sparse loading that ends
#    exact) and the CPU exactness tests of two families, as a baseline;
# 2. the TTFT benchmark with the model on the GPU, guest-cold, 2k and 8k tokens:
#    results/ttft-cuda.json (tables: python benchmarks/ttft.py --report results/ttft-cuda.json).
# Nothing here has run on a GPU yet (this project has none): expect to read, not to trust.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python
"$PY" - <<'PYEOF'
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda}): install a CUDA build of torch first")
print("CUDA:", torch.cuda.get_device_name(0), "torch", torch.__version__)
PYEOF
start=$(date +%s)
"$PY" -m pytest -q -m cuda tests/hf/test_cuda.py
"$PY" -m pytest -q tests/hf/test_exactness.py -k "llama or qwen3"
"$PY" benchmarks/ttft.py --device cuda --lengths 2048 8000 --repeats 3 --skip-recompute \
    --methods impress_1.0 impress_defaults impress_0.25_keep impress_0.25_full impress_1.0_memory \
    --out results/ttft-cuda.json
echo "device check done in $(( $(date +%s) - start )) s"
