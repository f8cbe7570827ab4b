#!/usr/bin/env bash
# A blind validation on a fresh H200, one call (a call gets a fresh machine): TABLE (a table corrected from serving
# runs) refreshed on the GPU at hand (`calibrate --refresh`), then the blind plan from the refreshed table on the
# points and traces of the plan V (committed before this call), its sha256 and time in the log before any real
# run, then the real runs of POINTS (a share of V's points) under it, in V-GPU. With PROBE set, the time left goes
# to scripts/prefill_probe.py on two of V's traces. Validations v12 (two calls), v13 and v15 ran it; v14 (two calls)
# ran its version of commits e6f08bc and 45cb560, which also refreshed TABLE from serving runs (since withdrawn);
# v16-v20 ran it too. Two calls on one warm GPU write the same two names: the later call's are kept beside the
# first's with the call's letter appended (v20's 673ad031c), where servecap.validate.comparison.plan_table finds them.
# Where V-GPU/plan.json is already there (a call's directory carried back in, or kept in .device/ by an earlier call
# on the same GPU, still warm), the call refreshes and plans nothing and resumes that plan's runs (v22's call a2 did
# so by hand).
# SERVING_V lists more plans of V's points, committed, each DIR or DIR:TRACE1,TRACE2: for each, TABLE is also
# refreshed by a serving probe (`calibrate --refresh --serving-probe`, with `--probe-trace TRACE1 TRACE2` where given)
# and DIR's plan made from that and frozen the same way before any run; the runs are V-GPU's, copied into DIR-GPU at
# the end, so that one set of runs grades every plan. (v31 ran it with one DIR, its table named TABLE-GPU-probe.json.)
# REFRESH=none runs V's own plan as committed (the table unrefreshed, README validation v32), in V-GPU as the others.
# OWN_FROM=ID1,ID2 with OWN_V=DIR (a README committed there): first the runs of these points of V (in V-GPU), then TABLE
# rescaled to this GPU's serving speed read from them (`calibrate --from-runs ... --rescale`, TABLE-GPU-own.json) and
# DIR-GPU's plan of V's points made from that and frozen the same way, before POINTS run; graded by V-GPU's runs with
# `grade_validation.py --against DIR-GPU V-GPU` (v40, v41, v42).
# CLOCK_V=DIR (a README committed there) with CLOCK_FIT=FIT.json and CHECK=the output of `calibrate
# --check-stationary` run on this GPU fresh, before the call: TABLE's prompt steps rescaled to this GPU's speed told by
# the SM clock that check left it at (`scripts/post_burst_clock.py rescale`, TABLE-GPU-clock.json) and DIR-GPU's plan
# of V's points made from that and frozen the same way before any run; the runs are V-GPU's, copied into DIR-GPU at
# the end (v48).
# The call ends by printing the runs still to make and the --only that makes them (`validate real --pending`), for
# POINTS of the next call on the same warm GPU.
# Usage: SERVECAP_GIT_COMMIT=<commit> TABLE=T.json V=DIR CALL=a|b|... POINTS=ID1,ID2,... [PROBE=1] [END_S=585] \
#          [GPU='NVIDIA H100 80GB HBM3'] [SERVING_V='DIR2 DIR3:T1,T2'] [REFRESH=none] [OWN_FROM=ID1,ID2 OWN_V=DIR] \
#          [CLOCK_V=DIR CLOCK_FIT=FIT.json CHECK=check.txt] \
#          bash scripts/h200_refreshed_validation.sh
#          (GPU: the device name expected; first, here, `bash scripts/device_tree.sh slim V TABLE [SERVING_V's DIRs]
#          [OWN_V]` so that what travels stays under the device's 64 MiB, and `restore` after the call)
set -u
source scripts/gpu_env.sh
L=logs/call-$CALL; mkdir -p $L; GPU=${GPU:-NVIDIA H200}; END=${END_S:-585}
nvidia-smi --query-gpu=name,uuid,driver_version,clocks.sm,power.limit --format=csv | tee $L/nvidia-smi.txt
gpu=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1 | cut -c5-12)
R=${TABLE%.json}-$gpu.json; VR=$V-$gpu; OR=${TABLE%.json}-$gpu-own.json; OVR=${OWN_V:-}-$gpu
CR=${TABLE%.json}-$gpu-clock.json; CVR=${CLOCK_V:-}-$gpu
probed() { d=${1%%:*}; SVR=$d-$gpu; SR=${TABLE%.json}-$gpu-${d##*validation-}.json; ST=${1#$d}; ST=${ST#:}; }
# A warm machine keeps git-ignored paths between calls: an earlier call's directory on this GPU comes back from there.
[ ! -f $VR/plan.json ] && [ -f .device/$VR/plan.json ] && mkdir -p $VR && cp -r .device/$VR/. $VR/ &&
  { [ -f $R ] || cp .device/$R $R; }
for sv in ${SERVING_V:-}; do
  probed $sv; [ ! -f $SVR/plan.json ] && [ -f .device/$SVR/plan.json ] && mkdir -p $SVR && cp -r .device/$SVR/. $SVR/ &&
    { [ -f $SR ] || cp .device/$SR $SR; }
done
if [ -f $VR/plan.json ]; then  # this GPU's frozen plan, carried in: its interrupted or missing runs resume under it
  echo "== resuming under $VR/plan.json"; (sha256sum $VR/plan.json; date -u +%FT%T.%NZ) | tee $L/plan-resumed.txt
elif [ "${REFRESH:-closed}" = none ]; then  # V's own plan, committed before the call, run as it is
  mkdir -p $VR && cp -r $V/plan.json $V/traces $VR/ && cp $TABLE $R
  (sha256sum $VR/plan.json; date -u +%FT%T.%NZ) | tee $L/plan-frozen.txt
else
  timeout 120 python3 -m calibrate --refresh $TABLE --backend paged --out $R --expect-gpu "$GPU" \
    > $L/refresh.txt 2>&1; tail -2 $L/refresh.txt
  timeout 120 python3 -m validate plan --table $R --out $VR --points-from $V --interval 90 > $L/plan.txt 2>&1
  tail -1 $L/plan.txt; (sha256sum $VR/plan.json; date -u +%FT%T.%NZ) | tee $L/plan-frozen.txt
fi
for sv in ${SERVING_V:-}; do
  probed $sv; n=$(basename $d); [ -f $SVR/plan.json ] && continue
  timeout 180 python3 -m calibrate --refresh $TABLE --serving-probe ${ST:+--probe-trace ${ST//,/ }} --backend paged \
    --out $SR --expect-gpu "$GPU" > $L/refresh-$n.txt 2>&1; tail -4 $L/refresh-$n.txt
  timeout 120 python3 -m validate plan --table $SR --out $SVR --points-from $d --interval 90 > $L/plan-$n.txt 2>&1
  tail -1 $L/plan-$n.txt; (sha256sum $SVR/plan.json; date -u +%FT%T.%NZ) | tee $L/plan-$n-frozen.txt
done
[ -n "${OWN_FROM:-}" ] && [ ! -f $OVR/plan.json ] && [ -f .device/$OVR/plan.json ] && mkdir -p $OVR &&
  cp -r .device/$OVR/. $OVR/ && cp .device/$OR $OR  # frozen by an earlier call on this GPU: never re-planned
if [ -n "${OWN_FROM:-}" ] && [ ! -f $OVR/plan.json ]; then
  timeout $((END - 40 - SECONDS)) python3 -m validate real --out $VR --only "$OWN_FROM" --expect-gpu "$GPU" \
    > $L/real-own.txt 2>&1; tail -1 $L/real-own.txt
  python3 -m calibrate --from-runs $(for p in ${OWN_FROM//,/ }; do echo $VR/real/$p; done) --table $TABLE --rescale \
    --out $OR > $L/rescale-own.txt 2>&1; cat $L/rescale-own.txt
  timeout 120 python3 -m validate plan --table $OR --out $OVR --points-from $V --interval 90 > $L/plan-own.txt 2>&1
  tail -1 $L/plan-own.txt; (sha256sum $OVR/plan.json; date -u +%FT%T.%NZ) | tee $L/plan-own-frozen.txt
fi
[ -n "${CLOCK_V:-}" ] && [ ! -f $CVR/plan.json ] && [ -f .device/$CVR/plan.json ] && mkdir -p $CVR &&
  cp -r .device/$CVR/. $CVR/ && cp .device/$CR $CR  # frozen by an earlier call on this GPU: never re-planned
if [ -n "${CLOCK_V:-}" ] && [ ! -f $CVR/plan.json ]; then
  python3 scripts/post_burst_clock.py rescale --check $CHECK --fit $CLOCK_FIT --table $TABLE --out $CR \
    > $L/rescale-clock.txt 2>&1; cat $L/rescale-clock.txt
  timeout 120 python3 -m validate plan --table $CR --out $CVR --points-from $V --interval 90 > $L/plan-clock.txt 2>&1
  tail -1 $L/plan-clock.txt; (sha256sum $CVR/plan.json; date -u +%FT%T.%NZ) | tee $L/plan-clock-frozen.txt
fi
left=$((END - 40 - SECONDS)); [ -n "${PROBE:-}" ] && left=$((left < 300 ? left : 300))
echo "== validate real $VR --only $POINTS, $left s ($(date -u +%T))"
timeout $left python3 -m validate real --out $VR --only "$POINTS" --expect-gpu "$GPU" > $L/real.txt 2>&1
tail -1 $L/real.txt
python3 -m validate real --out $VR --pending > $L/pending.txt 2>&1; head -1 $L/pending.txt; tail -1 $L/pending.txt
for run in chunked512-azure-conv-past:chunked:512 sharegpt-past:padded; do
  [ -n "${PROBE:-}" ] && [ $((END - 20 - SECONDS)) -ge 50 ] || break
  timeout $((END - 20 - SECONDS)) python3 scripts/prefill_probe.py --trace $V/traces/${run%%:*}.csv \
    --policy ${run#*:} --out $L/probe-${run%%:*} > $L/probe-${run%%:*}.txt 2>&1; tail -9 $L/probe-${run%%:*}.txt
done
mkdir -p .device/$(dirname $VR) .device/$(dirname $R) && rm -rf .device/$VR && cp -r $VR .device/$VR && cp $R .device/$R
keep="$R $VR"
[ -f $OVR/plan.json ] && rm -rf .device/$OVR && cp -r $OVR .device/$OVR && cp $OR .device/$OR && keep="$keep $OR $OVR"
if [ -n "${CLOCK_V:-}" ] && [ -f $CVR/plan.json ]; then
  rm -rf $CVR/real; [ -d $VR/real ] && cp -r $VR/real $CVR/real
  rm -rf .device/$CVR && cp -r $CVR .device/$CVR && cp $CR .device/$CR; keep="$keep $CR $CVR"
fi
for sv in ${SERVING_V:-}; do
  probed $sv; [ -f $SVR/plan.json ] || continue
  rm -rf $SVR/real && cp -r $VR/real $SVR/real; rm -rf .device/$SVR && cp -r $SVR .device/$SVR && cp $SR .device/$SR
  keep="$keep $SR $SVR"; [ -d $SR.runs ] && keep="$keep $SR.runs"
done
tar czf $OUT/out.tgz $keep logs
ls -la $OUT; echo "elapsed $SECONDS s"
