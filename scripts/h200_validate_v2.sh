#!/usr/bin/env bash
# One fresh H200, the blind validation of T4-serving (results/validation-v2/plan.json, frozen and committed before
# this runs): the parity gate under the margin-only near-tie rule, the public-trace points given in POINTS (each
# repeat on a freshly started engine), then, if time is left, the stationarity check on this third fresh GPU.
# Usage: SERVECAP_GIT_COMMIT=<commit> POINTS=id1,id2,... bash scripts/h200_validate_v2.sh
set -u
source scripts/gpu_env.sh
V=results/validation-v2; L=$OUT/logs; mkdir -p $L; GPU="NVIDIA H200"; END=${END_S:-570}
nvidia-smi --query-gpu=name,uuid,driver_version,clocks.sm,power.limit --format=csv | tee $L/nvidia-smi.txt
timeout 150 python3 -m engine gate --expect-gpu "$GPU" > $L/gate.txt 2>&1; tail -2 $L/gate.txt
left=$((END - 100 - SECONDS))
echo "== validate real, $left s ($(date -u +%T))"
timeout $left python3 -m validate real --out $V --only "$POINTS" --expect-gpu "$GPU" > $L/real.txt 2>&1
tail -2 $L/real.txt
left=$((END - SECONDS))
if [ $left -ge 95 ]; then
  echo "== check-stationary, $left s ($(date -u +%T))"
  timeout $left python3 -m calibrate --check-stationary --expect-gpu "$GPU" 2>&1 | grep -v "it/s]\|s/run]" \
    > $L/check-stationary.txt; tail -2 $L/check-stationary.txt
fi
tar czf $OUT/validation-v2.tgz $V/real $L; ls -la $OUT; echo "elapsed $SECONDS s"
