#!/usr/bin/env bash
# An engine change's host work on one fresh H200, one call:
#   1. OLD (an export of the engine before the change, with its own scripts/engine_noise.py) and this engine side by
#      side, a fresh engine each, alternating which goes first, on two of v24's traces: each run's busy time cut into
#      the device's and the host's (scripts/engine_noise.py);
#   2. with the time left, the runs of plan V (frozen from the table before the change and committed before this
#      call, one fresh engine per point): that table's blind prediction of this engine, and the serving steps that
#      correct it for this engine.
# v25-serving ran it for 3f31021 (less host work before a launch; OLD its parent), v26-serving for afaebb9 (a pass's
# first decode step launched right behind its prefill; OLD 13a23bc).
# Usage: SERVECAP_GIT_COMMIT=<commit> OLD=.bench/old V=results/validation-v26-serving [ROUNDS=2] [END_S=585] \
#          bash scripts/h200_host_trim.sh
set -u
source scripts/gpu_env.sh
L=logs/call-a; mkdir -p $L; GPU="NVIDIA H200"; END=${END_S:-585}
nvidia-smi --query-gpu=name,uuid,driver_version,clocks.sm,power.limit --format=csv | tee $L/nvidia-smi.txt
R="results/validation-v24/traces/mixed512-azure-conv-past.csv:mixed:512
   results/validation-v24/traces/chunked512-azure-conv-past.csv:chunked:512"
old=$(cd $OLD && pwd); here=$PWD
noise() {  # TREE TAG: one fresh engine of that tree replays R
  (cd $1 && PYTHONPATH=/tmp/site:$1 timeout 90 python3 scripts/engine_noise.py --out $here/noise-$2 --engines 1 \
     --tag "$2$round-" --replay $(for r in $R; do echo $here/${r%%:*}:${r#*:}; done)) >> $L/noise.txt 2>&1
}
for round in $(seq ${ROUNDS:-2}); do
  [ $((END - 20 - SECONDS)) -ge 200 ] || break
  if [ $((round % 2)) = 1 ]; then noise $old old; noise $here new; else noise $here new; noise $old old; fi
done
grep -h "engine 0" $L/noise.txt
left=$((END - 40 - SECONDS))
echo "== validate real $V, $left s ($(date -u +%T))"
[ $left -ge 30 ] && timeout $left python3 -m validate real --out $V --expect-gpu "$GPU" > $L/real.txt 2>&1
tail -1 $L/real.txt
tar czf $OUT/out.tgz $V logs noise-*
ls -la $OUT; echo "elapsed $SECONDS s"
