#!/usr/bin/env bash
# Second call, part 2, on the same machine: whatever single-engine points part 1 did not finish (they resume), then
# the fleet points: two replicas, one per GPU, behind each router.
set -u
source scripts/gpu_env.sh
W=/root/servecap-run; V=$W/validation; GPU="NVIDIA H200"
[ -f $V/plan.json ] || { echo "no plan from part 1 in $V"; exit 1; }
for i in 0 1; do
  (CUDA_VISIBLE_DEVICES=$i timeout 300 python3 -m validate real --out $V --shard $((i + 1))/2 --expect-gpu "$GPU" \
    > $W/logs/real-b-$i.txt 2>&1) &
done
wait
timeout $((580 - SECONDS)) python3 -m validate real --out $V --fleet 0,1 --expect-gpu "$GPU" 2>&1 | grep -v "it/s]" \
  | tail -20 | tee $W/logs/fleet.txt
tail -3 $W/logs/real-b-*.txt
cd /root && tar czf $OUT/validate-b.tgz servecap-run; ls -la $OUT; echo "elapsed $SECONDS s"
