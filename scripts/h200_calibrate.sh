#!/usr/bin/env bash
# One fresh H200 (or the GPU named by GPU, its files named by PREFIX): a full calibration (its stationarity check
# first, fused steps included), the whole console output kept beside the table, its points and GPU telemetry.
# Usage (device tool, repository root):
#   SERVECAP_GIT_COMMIT=<commit> NAME=t6 [ARGS='--backend paged'] [GPU='NVIDIA H100 80GB HBM3' PREFIX=h100] \
#     bash scripts/h200_calibrate.sh
set -u
source scripts/gpu_env.sh
L=$OUT/$NAME; mkdir -p $L; GPU=${GPU:-NVIDIA H200}; PREFIX=${PREFIX:-h200}
nvidia-smi --query-gpu=name,uuid,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv | tee $L/nvidia-smi.txt
timeout ${LIMIT_S:-560} python3 -m calibrate --out $L/$PREFIX-$NAME.json --expect-gpu "$GPU" ${ARGS:-} 2>&1 \
  | grep -v "calibrating:" > $L/calibrate.txt
tail -16 $L/calibrate.txt
cd $OUT && tar czf $NAME.tgz $NAME && rm -rf $NAME; ls -la $OUT; echo "elapsed $SECONDS s"
