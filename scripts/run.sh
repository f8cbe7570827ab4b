#!/usr/bin/env bash
# Set up the simulator (no torch needed) and run the main job: the default sweep on the shipped H200 cost table.
# Extra arguments go to `python -m sim` (e.g. --out DIR, --rates 10,20,40).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e .
exec .venv/bin/python -m sim "$@"
