#!/usr/bin/env bash
# One fresh H200 for the engine that writes a pass's records behind its next step (T10, validation v11), in two
# calls on one machine:
#   PHASE=calibrate: `calibrate --backend paged` (T10, closed runs only); then the blind plan from it, on the points
#     and traces of results/validation-v11-t9 (committed before this call), its sha256 and time in the log before
#     any real run; then the plan's real runs while time is left.
#   PHASE=real: the plan's runs left (`validate real` resumes after the complete ones); then, with the time left,
#     the parity gate, and the engine before (OLD: an export of it, with its own scripts/engine_noise.py) and this
#     one side by side on two of the plan's traces, a fresh engine each, alternating.
# Usage: SERVECAP_GIT_COMMIT=<commit> PHASE=calibrate|real [OLD=.bench/old] [END_S=585] bash scripts/h200_t10.sh
set -u
source scripts/gpu_env.sh
L=$OUT/logs; mkdir -p $L; GPU="NVIDIA H200"; END=${END_S:-585}
T=results/calibration/t10; V=results/validation-v11
nvidia-smi --query-gpu=name,uuid,driver_version,clocks.sm,power.limit --format=csv | tee $L/nvidia-smi-$PHASE.txt
if [ "$PHASE" = calibrate ]; then
  mkdir -p $T
  timeout 330 python3 -m calibrate --out $T/h200-t10.json --backend paged --expect-gpu "$GPU" > $L/calibrate.txt 2>&1
  grep -v "it/s\|run/s\|s/run" $L/calibrate.txt | tail -25
  timeout 120 python3 -m validate plan --table $T/h200-t10.json --out $V --points-from results/validation-v11-t9 \
    --interval 90 > $L/plan.txt 2>&1
  tail -2 $L/plan.txt; (sha256sum $V/plan.json; date -u +%FT%T.%NZ) | tee $L/plan-frozen.txt
fi
left=$((END - 40 - SECONDS)); [ "$PHASE" = real ] && left=$((left < 330 ? left : 330))
if [ $left -ge 30 ]; then
  echo "== validate real $V, $left s ($(date -u +%T))"
  timeout $left python3 -m validate real --out $V --expect-gpu "$GPU" > $L/real-$PHASE.txt 2>&1; tail -2 $L/real-$PHASE.txt
fi
if [ "$PHASE" = real ]; then
  left=$((END - 20 - SECONDS))
  [ $left -ge 60 ] && { timeout $((left < 150 ? left : 150)) python3 -m engine gate --expect-gpu "$GPU" > $L/gate.txt 2>&1
                         tail -1 $L/gate.txt; }
  R="$V/traces/chunked512-azure-conv-past.csv:chunked:512 $V/traces/sharegpt-past.csv:padded"
  old=$(cd ${OLD:-.bench/old} && pwd)
  for round in 1 2; do
    [ $((END - 20 - SECONDS)) -ge 80 ] || break
    (cd $old && PYTHONPATH=/tmp/site:$old timeout 70 python3 scripts/engine_noise.py --out $OUT/noise-old \
      --engines 1 --tag "old$round-" --replay $(for r in $R; do echo $OLDPWD/${r%%:*}:${r#*:}; done)) \
      >> $L/noise-old.txt 2>&1
    [ $((END - 20 - SECONDS)) -ge 70 ] || break
    timeout 70 python3 scripts/engine_noise.py --out $OUT/noise-new --engines 1 --tag "new$round-" --replay $R \
      >> $L/noise-new.txt 2>&1
  done
  grep -h "engine 0" $L/noise-old.txt $L/noise-new.txt
fi
mv $L $OUT/noise-* . 2>/dev/null; tar czf $OUT/out.tgz $T $V logs noise-* 2>/dev/null
ls -la $OUT; echo "elapsed $SECONDS s"
