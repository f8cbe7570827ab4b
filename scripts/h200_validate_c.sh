#!/usr/bin/env bash
# Second call, after the first command: table T2 failed its stationarity check (p95 1.21 > 1.15), so the plan is
# made from it with --allow-nonstationary (recorded in the plan), then both GPUs run the single-engine points and
# then the fleet points.
set -u
source scripts/gpu_env.sh
W=/root/servecap-run; V=$W/validation; T=$W/h200-t2.json; GPU="NVIDIA H200"
timeout 150 python3 -m validate plan --table $T --out $V --azure .data/AzureLLMInferenceTrace_conv.csv \
  --sharegpt .data/sharegpt_8k_filtered_stats_llama2_tokenizer.csv --predictions results/predictions \
  --sag results/sag/candidates.json --allow-nonstationary 2>&1 | grep -v warning | tail -45 | tee $W/logs/plan.txt
[ -f $V/plan.json ] || { echo "no plan"; cd /root && tar czf $OUT/validate.tgz servecap-run; exit 1; }
for i in 0 1; do
  (CUDA_VISIBLE_DEVICES=$i timeout $((420 - SECONDS)) python3 -m validate real --out $V --shard $((i + 1))/2 \
    --expect-gpu "$GPU" > $W/logs/real-$i.txt 2>&1) &
done
wait
tail -2 $W/logs/real-*.txt
timeout $((575 - SECONDS)) python3 -m validate real --out $V --fleet 0,1 --expect-gpu "$GPU" 2>&1 | grep -v "it/s]" \
  | tail -8 | tee $W/logs/fleet.txt
cd /root && tar czf $OUT/validate.tgz servecap-run; ls -la $OUT; echo "elapsed $SECONDS s"
