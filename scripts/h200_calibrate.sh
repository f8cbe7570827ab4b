#!/usr/bin/env bash
# On the H200: the parity gate, the calibration that writes the shipped cost table, and the engine benchmark.
set -u
source scripts/gpu_env.sh
mkdir -p $OUT/logs
timeout 150 python3 -m engine gate --expect-gpu "NVIDIA H200" 2>&1 | tee $OUT/logs/gate.txt
timeout 420 python3 -m calibrate --out $OUT/h200.json --expect-gpu "NVIDIA H200" 2>&1 | tee $OUT/logs/calibrate.txt
timeout 240 python3 -m engine.bench --out $OUT/bench --expect-gpu "NVIDIA H200" 2>&1 | tail -60 | tee $OUT/logs/bench.txt
ls -la $OUT
