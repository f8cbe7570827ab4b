#!/usr/bin/env bash
# On one freshly started H200: the stationarity check as it was (repetitions back to back) and with every
# repetition starting after the same idle wait, each on a freshly started engine, with the GPU's SM clock, power and
# temperature sampled every 100 ms throughout; then (optionally) the parity gate (GATE=1) and a full calibration with
# the new check (CALIBRATE=1).
# Usage (device tool, repository root): SERVECAP_GIT_COMMIT=<commit> [GATE=1] [CALIBRATE=1] bash scripts/h200_stationary.sh
set -u
source scripts/gpu_env.sh
L=$OUT/stationary; mkdir -p $L; GPU="NVIDIA H200"
nvidia-smi --query-gpu=name,uuid,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv | tee $L/nvidia-smi.txt
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,utilization.gpu --format=csv,nounits -lms 100 \
  > $L/telemetry.csv &
TEL=$!
for settle in 0 0.5; do
  echo "== check-stationary --settle-s $settle ($(date -u +%T))"
  timeout 200 python3 -m calibrate --check-stationary --settle-s $settle --expect-gpu "$GPU" 2>&1 \
    | grep -v "it/s]\|s/run]" | tee $L/check-settle-$settle.txt | tail -4
done
if [ "${GATE:-0}" = 1 ]; then
  echo "== parity gate ($(date -u +%T))"
  timeout 150 python3 -m engine gate --expect-gpu "$GPU" 2>&1 | tee $L/gate.txt | tail -3
fi
if [ "${CALIBRATE:-0}" = 1 ]; then
  left=$((560 - SECONDS))
  echo "== full calibration, $left s left ($(date -u +%T))"
  timeout $left python3 -m calibrate --out $L/h200-t${TABLE:-3}.json --expect-gpu "$GPU" 2>&1 | grep -v "calibrating:" \
    > $L/calibrate.txt; tail -14 $L/calibrate.txt
fi
kill $TEL
cd $OUT && tar czf stationary.tgz stationary && rm -rf stationary; ls -la $OUT; echo "elapsed $SECONDS s"
