#!/usr/bin/env bash
# First look at the engine on the H200: kernel tests, the parity gate, the kernel and engine benchmarks.
set -u
source scripts/gpu_env.sh
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee $OUT/logs/nvidia-smi.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
timeout 150 python3 -m pytest -q -x tests/test_kernels.py 2>&1 | tail -15 | tee $OUT/logs/kernels.txt
timeout 200 python3 -m engine gate --expect-gpu "NVIDIA H200" 2>&1 | tee $OUT/logs/gate.txt
timeout 90 python3 -m engine.kernels.bench 2>&1 | tail -25 | tee $OUT/logs/kernel_bench.txt
timeout 200 python3 -m engine.bench --quick --out $OUT/bench 2>&1 | tail -40 | tee $OUT/logs/bench.txt
