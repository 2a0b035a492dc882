#!/usr/bin/env bash
# Set up, then run the whole test suite (slow model-level tests included) and build the docs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
.venv/bin/mkdocs build --strict -q -d "$(mktemp -d)"
echo "docs: mkdocs build --strict passed"
