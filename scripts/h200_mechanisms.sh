#!/usr/bin/env bash
# One fresh H200: the parity gate (now also fused steps and on-demand admission with preemption), then the real
# runs of a frozen blind plan (PLAN: results/validation-v3 or results/validation-v3-cache, committed before this
# runs), then EXTRA (a command, optional) with what time is left.
# Usage: SERVECAP_GIT_COMMIT=<commit> PLAN=results/validation-v3 [GATE=1] [EXTRA='...'] bash scripts/h200_mechanisms.sh
set -u
source scripts/gpu_env.sh
L=$OUT/logs; mkdir -p $L; GPU="NVIDIA H200"; END=${END_S:-575}
nvidia-smi --query-gpu=name,uuid,driver_version,clocks.sm,power.limit --format=csv | tee $L/nvidia-smi.txt
if [ "${GATE:-0}" = 1 ]; then
  timeout 200 python3 -m engine gate --expect-gpu "$GPU" > $L/gate.txt 2>&1; tail -2 $L/gate.txt
fi
left=$((END - 40 - SECONDS))
echo "== validate real $PLAN, $left s ($(date -u +%T))"
timeout $left python3 -m validate real --out $PLAN --expect-gpu "$GPU" > $L/real.txt 2>&1
tail -3 $L/real.txt
left=$((END - 20 - SECONDS))
if [ -n "${EXTRA:-}" ] && [ $left -ge 60 ]; then
  echo "== extra, $left s ($(date -u +%T))"
  timeout $left bash -c "$EXTRA" > $L/extra.txt 2>&1; tail -3 $L/extra.txt
fi
tar czf $OUT/real.tgz $PLAN/real $L; ls -la $OUT; echo "elapsed $SECONDS s"
