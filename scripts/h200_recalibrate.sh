#!/usr/bin/env bash
# On the H200: calibrate again with settled decode steps at five uniform lengths (resuming the prefill grid and the
# long-prompt runs from the committed points file), then diagnose the Azure window's slow prefills: the same
# trace twice in one engine (first use of each prefill shape against second), and once with expandable segments.
set -u
source scripts/gpu_env.sh
mkdir -p $OUT/logs
cp results/calibration/h200.points.jsonl $OUT/h200.json.points.jsonl
timeout 280 python3 -m calibrate --out $OUT/h200.json --expect-gpu "NVIDIA H200" 2>&1 | grep -v "calibrating:" | tee $OUT/logs/calibrate.txt
A=results/validation/traces/azure-conv-window.csv
timeout 90 python3 -m engine run --trace $A --repeat 2 --no-tokens --out $OUT/azure-diag/default 2>&1 | grep -v "it/s\|req/s]" | tee $OUT/logs/azure-diag.txt
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 70 python3 -m engine run --trace $A --no-tokens \
  --out $OUT/azure-diag/expandable 2>&1 | grep -v "it/s\|req/s]" | tee -a $OUT/logs/azure-diag.txt
tar czf $OUT/azure-diag.tgz -C $OUT azure-diag && rm -rf $OUT/azure-diag
echo "elapsed $SECONDS s"
