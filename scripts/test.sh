#!/usr/bin/env bash
# Set up, then run every test (GPU tests skip without a GPU; the kernels run under Triton's interpreter).
# Two pytest-xdist workers, one per core of a CI machine, each taking the next two tests as it frees up; the tests
# marked slow come first (tests/conftest.py), so the long interpreter runs start early, spread over both workers,
# and the many short ones even them out at the end. Pass -n 0 to run in this process, -n 4 for four workers.
# The slowest tests are listed at the end; the long interpreter runs print a line per stage as they go.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q -n 2 --dist load --maxschedchunk 2 --durations=15 "$@"
