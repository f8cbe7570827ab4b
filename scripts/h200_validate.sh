#!/usr/bin/env bash
# On two H200s, second call, part 1 (blind validation): GPU 0 calibrates the engine with every prefill policy
# (table T2) while GPU 1 runs the kernels' GPU tests, the parity gate (policies included), the engine bench and a
# refresh of the first table on this other GPU; then the plan is made from T2, its predictions frozen in, and only
# then do both GPUs run its single-engine points. Everything lives in $W, which part 2 continues from.
# Usage: SERVECAP_GIT_COMMIT=<commit> bash scripts/h200_validate.sh
set -u
source scripts/gpu_env.sh
W=/root/servecap-run; V=$W/validation; T=$W/h200-t2.json; GPU="NVIDIA H200"
mkdir -p $W/logs
nvidia-smi --query-gpu=index,name,uuid,memory.total,clocks.sm --format=csv | tee $W/logs/nvidia-smi.txt
(CUDA_VISIBLE_DEVICES=0 timeout 330 python3 -m calibrate --out $T --expect-gpu "$GPU" 2>&1 | grep -v "calibrating:" \
  > $W/logs/calibrate.txt) &
(export CUDA_VISIBLE_DEVICES=1
 timeout 120 python3 -m pytest -q -x tests/test_kernels.py 2>&1 | tail -5 > $W/logs/kernels.txt
 timeout 150 python3 -m engine gate --expect-gpu "$GPU" > $W/logs/gate.txt 2>&1
 timeout 150 python3 -m engine.bench --out $W/bench --expect-gpu "$GPU" 2>&1 | grep -v "it/s]" > $W/logs/bench.txt
 timeout 100 python3 -m calibrate --refresh results/calibration/t1/h200-t1-refit.json --out $W/h200-t1-refresh-gpu1.json \
   --expect-gpu "$GPU" > $W/logs/refresh.txt 2>&1) &
wait
tail -8 $W/logs/calibrate.txt; tail -3 $W/logs/kernels.txt; tail -2 $W/logs/gate.txt; tail -4 $W/logs/refresh.txt
[ -f $T ] || { echo "no table T2: stopping"; exit 1; }
timeout 240 python3 -m validate plan --table $T --out $V --azure .data/AzureLLMInferenceTrace_conv.csv \
  --sharegpt .data/sharegpt_8k_filtered_stats_llama2_tokenizer.csv --predictions results/predictions \
  --sag results/sag/candidates.json 2>&1 | tail -50 | tee $W/logs/plan.txt
[ -f $V/plan.json ] || { echo "no plan: stopping"; exit 1; }
left=$((590 - SECONDS))
for i in 0 1; do
  (CUDA_VISIBLE_DEVICES=$i timeout $left python3 -m validate real --out $V --shard $((i + 1))/2 --expect-gpu "$GPU" \
    > $W/logs/real-$i.txt 2>&1) &
done
wait
tail -3 $W/logs/real-*.txt
cd /root && tar czf $OUT/validate-a.tgz servecap-run; ls -la $OUT; echo "elapsed $SECONDS s"
