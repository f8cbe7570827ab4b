#!/usr/bin/env bash
# Set up .venv with everything the project needs on a CPU machine (the GPU image brings its own torch).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first and pinned: a bare requirement would pull a multi-GB CUDA build.
python -m pip install -q -c .ci/constraints.txt torch
python -m pip install -q -c .ci/constraints.txt -e ".[engine,modal,dev]"
