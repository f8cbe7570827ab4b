#!/usr/bin/env bash
# One fresh H200: the full-length calibration (32 rows to 4096 and prompts to 32256 in one table, the engine capped at
# 131072 tokens a prefill step; its stationarity check first), then a smoke run of the engine serving full-length
# Mooncake prompts under the cap, from a window of the trace no plan uses. Usage (device tool, repository root):
#   SERVECAP_GIT_COMMIT=<commit> NAME=t7 bash scripts/h200_full_length.sh
set -u
source scripts/gpu_env.sh
L=$OUT/$NAME; mkdir -p $L; GPU="NVIDIA H200"
nvidia-smi --query-gpu=name,uuid,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv | tee $L/nvidia-smi.txt
timeout ${LIMIT_S:-470} python3 -m calibrate --full-length --backend paged --out $L/h200-$NAME.json --expect-gpu "$GPU" \
  2>&1 | grep -v "calibrating:" > $L/calibrate.txt
tail -16 $L/calibrate.txt
if [ -n "${SMOKE:-}" ]; then
  timeout 100 python3 -m engine run --trace "$SMOKE" --max-prompt 32256 --max-budget 512 --max-num-batched-tokens 131072 \
    --no-tokens --out $L/smoke --expect-gpu "$GPU" > $L/smoke.txt 2>&1; tail -4 $L/smoke.txt
fi
cd $OUT && tar czf $NAME.tgz $NAME && rm -rf $NAME; ls -la $OUT; echo "elapsed $SECONDS s"
