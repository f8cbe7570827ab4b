#!/usr/bin/env bash
# The device tool sends the tracked and untracked-not-ignored files, 64 MiB at most, and results/ alone holds
# several hundred: `slim PATH...` leaves only PATHs of results/ in the index (what a GPU call reads: its plan
# directory, its table) and ignores the rest of results/ for the call; `restore` puts the index back as HEAD has
# it. Nothing on disk changes either way, and commits are refused while slim (the index then drops results/).
# Usage: bash scripts/device_tree.sh slim results/validation-v44 results/calibration/t10/h200-t10-v27.json
#        (the device call, carrying .whl)
#        bash scripts/device_tree.sh restore
set -eu
cd "$(git rev-parse --show-toplevel)"
exclude=$(git rev-parse --git-path info/exclude); hook=$(git rev-parse --git-path hooks)/pre-commit
mark="# device_tree.sh slim"
case "${1:-}" in
  slim)
    shift; [ $# -gt 0 ] || { echo "device_tree.sh: slim needs the results/ paths the call reads" >&2; exit 2; }
    for p in "$@"; do [ -e "$p" ] || { echo "device_tree.sh: no such path: $p" >&2; exit 2; }; done
    grep -qx "$mark" "$exclude" 2>/dev/null && { echo "device_tree.sh: already slim (restore first)" >&2; exit 2; }
    git diff --cached --quiet -- results || { echo "device_tree.sh: results/ has staged changes" >&2; exit 2; }
    [ -e "$hook" ] && { echo "device_tree.sh: $hook exists; it would be replaced" >&2; exit 2; }
    mkdir -p "$(dirname "$hook")" "$(dirname "$exclude")"  # the commit guard first: the index changes after it
    printf '#!/bin/sh\necho "slim for a device call: bash scripts/device_tree.sh restore" >&2; exit 1\n' > "$hook"
    chmod +x "$hook"; printf '%s\n/results/\n' "$mark" >> "$exclude"
    git rm -r --cached -q results && git add -f -- "$@"
    git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {printf "travels: %.1f MiB tracked\n", s / 1048576}';;
  restore)  # only after slim: a reset then would unstage results/ changes made for a commit
    grep -qx "$mark" "$exclude" 2>/dev/null || grep -qs "device_tree.sh restore" "$hook" ||
      { echo "device_tree.sh: not slim, nothing to restore" >&2; exit 2; }
    git reset -q -- results
    [ -f "$exclude" ] && sed -i "/^$mark\$/,/^\/results\/\$/d" "$exclude"
    grep -qs "device_tree.sh restore" "$hook" && rm -f "$hook"; git status --short | head -3;;
  *) echo "usage: device_tree.sh slim PATH... | restore" >&2; exit 2;;
esac
