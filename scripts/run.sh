#!/usr/bin/env bash
# Set up the simulator (no torch needed) and run the main job: the default sweep on the shipped H200 cost table.
# Extra arguments go to `python -m sim` (e.g. --out DIR, --rates 10,20,40).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
# The install is editable, so only a changed pyproject.toml (dependencies, console scripts) needs another: the
# stamp holds the hash of the one last installed.
stamp=.venv/.servecap-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e .
    echo "$want" > "$stamp"
fi
exec .venv/bin/python -m servecap.sim "$@"
