#!/usr/bin/env bash
# Set up, then run every test (GPU tests skip without a GPU; the kernels run under Triton's interpreter).
# The slowest tests are listed at the end; the long interpreter runs print a line per stage as they go.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q --durations=15 "$@"
