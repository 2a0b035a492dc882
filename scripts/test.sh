#!/usr/bin/env bash
# Set up both environments, run the whole test suite (slow model-level tests included) on
# the newest supported transformers (.venv, 5.24), the transformers-facing tests (tests/hf:
# exactness on every tiny architecture and SmolLM2, binding, cache protocol, hooks, guards,
# sparse prefills) on the oldest (.venv523, 5.23), then build the docs.
# Both pytest runs spread the tests over $IMPRESS_TEST_WORKERS pytest-xdist workers (default
# 2, CI's cores; 0 runs them in this process). Extra arguments go to the first run only.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
status=0  # every stage runs; the script fails if any did
workers=${IMPRESS_TEST_WORKERS:-2}
echo "== transformers $(.venv/bin/python -c 'from importlib.metadata import version; print(version("transformers"))'): whole suite"
.venv/bin/python -m pytest -q -p no:cacheprovider -n "$workers" "$@" || status=1
echo "== transformers $(.venv523/bin/python -c 'from importlib.metadata import version; print(version("transformers"))'): tests/hf"
.venv523/bin/python -m pytest -q -p no:cacheprovider -n "$workers" tests/hf || status=1
site="$(mktemp -d)"
trap 'rm -rf "$site"' EXIT  # the built site is only checked, not kept
if .venv/bin/mkdocs build --strict -q -d "$site"; then
    echo "docs: mkdocs build --strict passed"
else
    status=1
fi
exit $status
