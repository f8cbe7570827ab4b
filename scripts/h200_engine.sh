#!/usr/bin/env bash
# On the H200, first call: the kernels' GPU tests, the parity gate, the engine and kernel benchmarks, and the
# calibration of the engine as it stands (padded prefill only): the table the prefill-policy predictions come from.
# Usage (device tool, from the repository root): SERVECAP_GIT_COMMIT=<commit> bash scripts/h200_engine.sh
set -u
source scripts/gpu_env.sh
mkdir -p $OUT/logs
GPU="NVIDIA H200"
nvidia-smi --query-gpu=name,uuid,memory.total,driver_version,clocks.sm --format=csv | tee $OUT/logs/nvidia-smi.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
timeout 150 python3 -m pytest -q -x tests/test_kernels.py 2>&1 | tail -15 | tee $OUT/logs/kernels.txt
if ! grep -q " passed" $OUT/logs/kernels.txt || grep -q "failed\|error" $OUT/logs/kernels.txt; then
  echo "kernel tests failed: stopping before anything is measured"; exit 1
fi
timeout 60 python3 -m engine.kernels.bench --only prefill 2>&1 | tail -20 | tee $OUT/logs/kernel_bench.txt
timeout 150 python3 -m engine gate --expect-gpu "$GPU" 2>&1 | tee $OUT/logs/gate.txt
timeout 150 python3 -m engine.bench --out $OUT/bench --expect-gpu "$GPU" 2>&1 | grep -v "it/s]" | tail -70 \
  | tee $OUT/logs/bench.txt
left=$((585 - SECONDS))
timeout $left python3 -m calibrate --out $OUT/h200-t1.json --expect-gpu "$GPU" 2>&1 | grep -v "calibrating:" \
  | tee $OUT/logs/calibrate.txt
cd $OUT && tar czf engine.tgz --remove-files logs bench h200-t1.json* 2>/dev/null; ls -la $OUT
echo "elapsed $SECONDS s"
