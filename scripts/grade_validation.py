"""The README's grading of a validation's real runs against its frozen plan, per the issues' targets.

Usage: PYTHONPATH=. python scripts/grade_validation.py TABLE VALIDATION [VALIDATION ...]

For each validation directory (plan.json and real/POINT/run-K, as `python -m validate plan` and `real` make them):
- at every arrival point, the mean of its repeats: served rate error, and TTFT p50 error against max(10%, the
  repeats' spread, (max - min) / median);
- each run's summed step time over its price in context on TABLE (servecap/costs/recorded.py), and the median
  real / model per step kind;
- the plan's 90% bands: the share of every run's measurements inside, by group (public, fused `mixed`, `cache`).
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import numpy as np

from servecap.costs.model import CostModel
from servecap.costs.recorded import contextual, priced_steps
from servecap.costs.table import load_cost_table
from servecap.traces.errors import InputError
from servecap.traces.metrics import scored
from servecap.traces.records import read_run


def group(point_id: str) -> str:
    return "mixed" if point_id.startswith("mixed") else "cache" if point_id.startswith("cache") else "public"


def grade(validation: Path, cost: CostModel) -> None:
    plan = json.loads((validation / "plan.json").read_text())
    bands = plan.get("intervals", {}).get("bands", {})
    targets, runs, kinds, inside = [], [], {}, {}
    for pid, predicted in plan["predictions"].items():
        recs = [read_run(d) for d in sorted((validation / "real" / pid).glob("run-*"))]
        if not recs:
            continue
        rate = recs[0].meta["trace"].get("rate")
        measured = [scored(r, rate) for r in recs]
        for rec in recs:
            steps = priced_steps(rec, cost)
            price = contextual(steps, cost.correction)
            runs.append(float(steps.real_s.sum() / price.sum()))
            for kind, g in steps.assign(price=price).groupby("kind"):
                kinds.setdefault(kind, []).extend((g.real_s / g.price).tolist())
        for key, band in bands.get(pid, {}).items():
            got = [m.get(key) for m in measured]
            inside.setdefault(group(pid), []).extend(band["lo"] <= x <= band["hi"] for x in got
                                                     if x is not None and np.isfinite(x))
        if rate is None:
            continue
        served = float(np.mean([m["served_rate"] for m in measured]))
        ttft = [m["ttft_p50"] for m in measured]
        spread = (max(ttft) - min(ttft)) / float(np.median(ttft)) if len(ttft) > 1 else 0.0
        e_served = predicted["served_rate"] / served - 1
        e_ttft = predicted["ttft_p50"] / float(np.mean(ttft)) - 1
        targets.append((pid, e_served, e_ttft, spread, abs(e_ttft) <= max(0.10, spread)))
    print(f"{validation}: {len(targets)} arrival points; served within 2%: "
          f"{sum(abs(t[1]) <= 0.02 for t in targets)}, within 3%: {sum(abs(t[1]) <= 0.03 for t in targets)}; "
          f"TTFT p50 within max(10%, spread): {sum(t[4] for t in targets)}")
    for pid, e_s, e_t, spread, ok in targets:
        print(f"  {pid:34s} served {e_s:+.1%}  TTFT p50 {e_t:+.1%} (spread {spread:.0%}) {'ok' if ok else 'MISS'}")
    r = np.array(runs)
    print(f"  each run's summed step time real / price in context: {r.min():.3f}-{r.max():.3f}, within 2%: "
          f"{int((abs(r - 1) <= 0.02).sum())} of {len(r)}")
    for kind, v in sorted(kinds.items()):
        print(f"  median real / price in context, {kind:22s} n={len(v):6d} {np.median(v):.3f}")
    for g, v in sorted(inside.items()):
        print(f"  90% bands, {g} points: {sum(v)} of {len(v)} inside ({sum(v) / len(v):.1%})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("table", type=Path)
    p.add_argument("validations", type=Path, nargs="+")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")  # extrapolation notes about a few long steps; the grading reads every step
    try:
        cost = CostModel(load_cost_table(args.table))
        for v in args.validations:
            if not (v / "plan.json").is_file():
                raise InputError("holds no plan.json", path=v)
            grade(v, cost)
    except InputError as e:
        print(f"grade_validation: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
