#!/usr/bin/env bash
# Set up, then run every test (GPU tests skip without a GPU; the kernels run under Triton's interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q "$@"
