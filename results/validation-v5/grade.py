import glob, json, sys, warnings, numpy as np
warnings.simplefilter("ignore")
from pathlib import Path
from servecap.costs.table import load_cost_table
from servecap.costs.model import CostModel
from servecap.costs.recorded import priced_steps, contextual
from servecap.traces.records import read_run
from servecap.traces.metrics import summary
cm = CostModel(load_cost_table(sys.argv[1] if len(sys.argv) > 1 else "results/calibration/t6c-serving/h200-t6c-serving.json"))
for v in (sys.argv[2:] or ["results/validation-v5"]):
    plan = json.load(open(f"{v}/plan.json"))
    pts = {p["id"]: p for p in plan["points"]}
    sums, kinds = [], {}
    served2 = served3 = tt = 0; n = 0; lines = []
    for pid, pr in plan["predictions"].items():
        runs = sorted(glob.glob(f"{v}/real/{pid}/run-*"))
        recs = [read_run(r) for r in runs]
        rate = recs[0].meta["trace"].get("rate")
        for rec in recs:
            s = priced_steps(rec, cm); m = contextual(s, cm.correction)
            sums.append((pid, float(s.real_s.sum() / m.sum())))
            for k, g in s.assign(m=m).groupby("kind"):
                kinds.setdefault(k, []).extend((g.real_s / g.m).tolist())
        if rate is None: continue
        ss = [summary(r, rate) for r in recs]
        served = np.mean([x["served_rate"] for x in ss]); ttft = [x["ttft_p50"] for x in ss]
        e_s = pr["served_rate"] / served - 1
        spread = (max(ttft) - min(ttft)) / np.median(ttft) if len(ttft) > 1 else 0
        e_t = pr["ttft_p50"] / np.mean(ttft) - 1
        ok_t = abs(e_t) <= max(0.10, spread)
        n += 1; served2 += abs(e_s) <= 0.02; served3 += abs(e_s) <= 0.03; tt += ok_t
        lines.append(f"  {pid:32s} served {e_s:+.1%}  ttft50 {e_t:+.1%} spread {spread:.0%} {'ok' if ok_t else 'MISS'}")
    print(v, f"arrival points {n}: served within 2% {served2}, within 3% {served3}; TTFT p50 within max(10%, spread) {tt}")
    print("\n".join(lines))
    r = np.array([x for _, x in sums]); print(f"  runs' summed step time real/contextual: {r.min():.3f}-{r.max():.3f}, within 2%: {(abs(r-1)<=0.02).sum()} of {len(r)}")
    for k, x in sorted(kinds.items()): print(f"  median real/contextual {k:22s} n={len(x):6d} {np.median(x):.3f}")
