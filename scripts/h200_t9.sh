#!/usr/bin/env bash
# One fresh H200, the engine that launches decode steps ahead (decode stretches), in two calls.
#   PHASE=check: the parity gate, then the old engine (OLD: a checkout of the engine before, with its own
#     scripts/engine_noise.py) and this one side by side, two fresh engines each, on two validation traces.
#   PHASE=calibrate: `calibrate --backend paged --serving` (T9 and T9-serving, with the serving phase's runs).
# Usage: SERVECAP_GIT_COMMIT=<commit> PHASE=check|calibrate [OLD=.bench/old] bash scripts/h200_t9.sh
set -u
source scripts/gpu_env.sh
L=$OUT/logs; mkdir -p $L; GPU="NVIDIA H200"
nvidia-smi --query-gpu=name,uuid,driver_version,clocks.sm,power.limit --format=csv | tee $L/nvidia-smi-$PHASE.txt
if [ "$PHASE" = check ]; then
  timeout 200 python3 -m engine gate --expect-gpu "$GPU" > $L/gate.txt 2>&1; tail -2 $L/gate.txt
  R="results/validation-v5/traces/sharegpt-past.csv:padded results/validation-v7/traces/mixed512-azure-conv-past.csv:mixed:512"
  old=$(cd ${OLD:-.bench/old} && pwd)
  for round in 1 2; do
    (cd $old && PYTHONPATH=/tmp/site:$old timeout 150 python3 scripts/engine_noise.py --out $OUT/noise-old \
      --engines 1 --tag "old$round-" --replay $(for r in $R; do echo $OLDPWD/${r%%:*}:${r#*:}; done)) \
      >> $L/noise-old.txt 2>&1
    timeout 150 python3 scripts/engine_noise.py --out $OUT/noise-new --engines 1 --tag "new$round-" --replay $R \
      >> $L/noise-new.txt 2>&1
  done
  grep -h "engine 0" $L/noise-old.txt $L/noise-new.txt
  tar czf $OUT/check.tgz -C $OUT logs noise-old noise-new
elif [ "$PHASE" = calibrate ]; then
  T=$OUT/t9; mkdir -p $T
  timeout 560 python3 -m calibrate --out $T/h200-t9.json --serving $T/h200-t9-serving.json --backend paged \
    --expect-gpu "$GPU" > $L/calibrate.txt 2>&1
  grep -v "it/s\|run/s\|s/run" $L/calibrate.txt | tail -40
  tar czf $OUT/t9.tgz -C $OUT logs t9
fi
ls -la $OUT; echo "elapsed $SECONDS s"
