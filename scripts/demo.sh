#!/usr/bin/env bash
# Set up, then run the demo: SmolLM2 answers questions about one long document,
# without and with prefix reuse (results/demo.json).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python examples/demo.py "$@"
