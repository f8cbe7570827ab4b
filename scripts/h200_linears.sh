#!/usr/bin/env bash
# On the H200: the kernels' GPU tests, the decode products tuned (engine/kernels/linear_configs.json for this GPU),
# then with them the parity gate and the quick engine bench: tuned products against cuBLAS side by side, and the
# kernels of one 32 x 1024 decode step.
# Usage (device tool, from the repository root): SERVECAP_GIT_COMMIT=<commit> bash scripts/h200_linears.sh
set -u
source scripts/gpu_env.sh
mkdir -p $OUT/logs
GPU="NVIDIA H200"
nvidia-smi --query-gpu=name,uuid,memory.total,driver_version,clocks.sm --format=csv | tee $OUT/logs/nvidia-smi.txt
timeout 150 python3 -m pytest -q -x tests/test_kernels.py 2>&1 | tail -15 | tee $OUT/logs/kernels.txt
if ! grep -q " passed" $OUT/logs/kernels.txt || grep -q "failed\|error" $OUT/logs/kernels.txt; then
  echo "kernel tests failed: stopping before anything is measured"; exit 1
fi
timeout 240 python3 -m engine.kernels.tune_linear 2>&1 | tee $OUT/logs/tune.txt
cp engine/kernels/linear_configs.json $OUT/
timeout 120 python3 -m engine gate --expect-gpu "$GPU" 2>&1 | tee $OUT/logs/gate.txt
timeout 200 python3 -m engine.bench --quick --profile --out $OUT/bench --expect-gpu "$GPU" 2>&1 | grep -v "it/s]" \
  | tail -80 | tee $OUT/logs/bench.txt
cd $OUT && tar czf linears.tgz --remove-files logs bench linear_configs.json 2>/dev/null; ls -la $OUT
echo "elapsed $SECONDS s"
