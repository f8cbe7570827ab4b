#!/usr/bin/env bash
# One fresh H200, for the engine whose fused steps attend their decode rows through the decode kernel: the parity
# gate, a full calibration (table $NAME), and fused steps side by side with the engine before the change (a tar of
# that commit's package, carried in .whl/old-engine.tar). Usage (device tool, repository root):
#   SERVECAP_GIT_COMMIT=<commit> NAME=t8 bash scripts/h200_mixed_decode.sh
set -u
source scripts/gpu_env.sh
L=$OUT/$NAME; mkdir -p $L; GPU="NVIDIA H200"
nvidia-smi --query-gpu=name,uuid,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv | tee $L/nvidia-smi.txt
timeout 100 python3 -m engine gate --expect-gpu "$GPU" > $L/gate.txt 2>&1; tail -3 $L/gate.txt
timeout ${LIMIT_S:-330} python3 -m calibrate --out $L/h200-$NAME.json --expect-gpu "$GPU" --backend paged 2>&1 \
  | grep -v "calibrating:" > $L/calibrate.txt
tail -16 $L/calibrate.txt
mkdir -p /tmp/old && tar xf .whl/old-engine.tar -C /tmp/old
timeout 150 python3 scripts/bench_mixed_side_by_side.py /tmp/old --out /tmp/bench --rounds 2 > $L/bench_mixed.txt 2>&1
tail -12 $L/bench_mixed.txt
cd $OUT && tar czf $NAME.tgz $NAME && rm -rf $NAME; ls -la $OUT; echo "elapsed $SECONDS s"
