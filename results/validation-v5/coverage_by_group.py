import glob, json, warnings, numpy as np, sys
warnings.simplefilter("ignore")
from servecap.traces.records import read_run
from servecap.traces.metrics import summary, closed_run
v=sys.argv[1]
plan=json.load(open(f"{v}/plan.json")); bands=plan["intervals"]["bands"]
grp={}
for pid,b in bands.items():
    g="mixed" if pid.startswith("mixed") else ("cache" if pid.startswith("cache") else "public")
    for r in sorted(glob.glob(f"{v}/real/{pid}/run-*")):
        rec=read_run(r); rate=rec.meta["trace"].get("rate"); s=summary(rec, rate)
        if rate is None: s.update(closed_run(rec))
        for k,bb in b.items():
            x=s.get(k)
            if x is None or not np.isfinite(x): continue
            grp.setdefault((g,k),[]).append(bb["lo"]<=x<=bb["hi"])
tot={}
for (g,k),v_ in sorted(grp.items()):
    tot.setdefault(g,[]).extend(v_); print(g,k,sum(v_),len(v_))
for g,v_ in tot.items(): print(g, sum(v_), len(v_), f"{sum(v_)/len(v_):.1%}")
