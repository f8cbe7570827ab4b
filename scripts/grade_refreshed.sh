#!/usr/bin/env bash
# A blind refreshed validation graded on the CPU, each output beside the runs it grades (v12-v26 ran these steps by
# hand). For each refreshed directory V-GPU (the plan made from the table refreshed on that GPU, and its runs):
# grade.txt (scripts/grade_validation.py), report.md with points.csv and validation.png, coverage.md, replay.md, and
# instance-spread.txt. Then the unrefreshed plan V graded on the same runs, linked into V/real (the first GPU's where
# two ran a point). Given EARLIER (the refreshed directories of earlier validations), every one's totals in
# V/grade-NAME.txt and the figure V/workflow.png.
# Usage: [EARLIER="DIR ..." NAME=v12-v27] bash scripts/grade_refreshed.sh V V-GPU [V-GPU ...]
set -eu
V=$1; shift
for d in "$@"; do
  echo "== $d"
  python scripts/grade_validation.py $d > $d/grade.txt
  python scripts/instance_spread.py $d > $d/instance-spread.txt
  for step in report coverage replay; do python -m validate $step --out $d --force > /dev/null; done
  mkdir -p $V/real
  for p in $d/real/*/; do
    p=$(basename $p); [ -e $V/real/$p ] || ln -s ../../$(basename $d)/real/$p $V/real/$p
  done
done
echo "== $V"
python scripts/grade_validation.py $V > $V/grade.txt
for step in report coverage; do python -m validate $step --out $V --force > /dev/null; done
if [ -n "${EARLIER:-}" ]; then
  echo "== ${NAME:?NAME names the totals, e.g. v12-v27}"
  python scripts/grade_validation.py $EARLIER "$@" > $V/grade-$NAME.txt
  python scripts/plot_workflow.py --out $V/workflow.png $EARLIER "$@"
fi
for d in "$@" $V; do head -1 $d/grade.txt; done
