#!/usr/bin/env bash
# On the H200, part 1: kernel tests, the parity gate, the calibration (the shipped table), the validation plan
# chosen from the new table's own sweep, and as many validation runs as fit (they resume in part 2).
set -u
source scripts/gpu_env.sh
mkdir -p $OUT/logs
timeout 120 python3 -m pytest -q -x tests/test_kernels.py 2>&1 | tail -5 | tee $OUT/logs/kernels.txt
grep -q " passed" $OUT/logs/kernels.txt && ! grep -q "failed" $OUT/logs/kernels.txt || { echo "kernel tests failed"; exit 1; }
timeout 60 python3 -m engine.kernels.bench 2>&1 | tail -14 | tee $OUT/logs/kernel_bench.txt
timeout 150 python3 -m engine gate --expect-gpu "NVIDIA H200" 2>&1 | tee $OUT/logs/gate.txt
timeout 300 python3 -m calibrate --out $OUT/h200.json --expect-gpu "NVIDIA H200" 2>&1 | grep -v "calibrating:" | tee $OUT/logs/calibrate.txt
[ -f $OUT/h200.json ] || exit 1
V=$OUT/validation
timeout 90 python3 -m sim validate plan --out $V --table $OUT/h200.json --azure .data/AzureLLMInferenceTrace_conv.csv 2>&1 | tee $OUT/logs/plan.txt
timeout $((570 - SECONDS)) python3 -m sim validate real --out $V --expect-gpu "NVIDIA H200" 2>&1 | tail -5 | tee $OUT/logs/real.txt
tar czf $OUT/validation.tgz -C $OUT validation && rm -rf $V
ls -la $OUT; echo "elapsed $SECONDS s"
