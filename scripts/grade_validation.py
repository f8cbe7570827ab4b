"""The README's grading of a validation's real runs against its frozen plan, per the issues' targets.

Usage: PYTHONPATH=. python scripts/grade_validation.py VALIDATION [VALIDATION ...]

For each validation directory (plan.json and real/POINT/run-K, as `python -m validate plan` and `real` make them),
compared with its plan under the protocol checks of servecap/validate/comparison.py, on the plan's own table:
- at every arrival point, the mean of its repeats: served rate error, and TTFT p50 error against max(10%, the
  repeats' spread, (max - min) / median);
- each run's summed step time over its price in context (servecap/costs/recorded.py), and the median real / price
  per step kind, the price a typical step's (a correction's class medians, where it has them);
- the plan's 90% bands: the share of every run's measurements inside (servecap/validate/coverage.py), by the
  points' role (public, mixed, prefix-cache).
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
from servecap.sim import inputs
from servecap.traces.errors import InputError
from servecap.traces.records import read_run
from servecap.validate.comparison import compare
from servecap.validate.coverage import coverage
from servecap.validate.points import run_dir


def grade(validation: Path) -> None:
    table_path = Path(json.loads((validation / "plan.json").read_text())["table"]["path"])
    plan, results = compare(validation, table_path)
    cost = CostModel(inputs.load_table(table_path))
    targets, runs, kinds = [], [], {}
    for c in results:
        for k in range(1, len(c.real) + 1):
            steps = priced_steps(read_run(run_dir(validation, c.point, k)), cost)
            price = contextual(steps, cost.correction)
            runs.append(float(steps.real_s.sum() / price.sum()))
            typical = contextual(steps, cost.correction, typical=True)
            for kind, r in (steps.real_s / typical).groupby(steps.kind):
                kinds.setdefault(kind, []).extend(r.tolist())
        if c.point.trace.get("kind") == "closed-mixed":
            continue
        served = float(np.mean([m["served_rate"] for m in c.real]))
        ttft = [m["ttft_p50"] for m in c.real]
        spread = (max(ttft) - min(ttft)) / float(np.median(ttft)) if len(ttft) > 1 else 0.0
        e_served = c.sim["served_rate"] / served - 1
        e_ttft = c.sim["ttft_p50"] / float(np.mean(ttft)) - 1
        targets.append((c.point.id, e_served, e_ttft, spread, abs(e_ttft) <= max(0.10, spread)))
    print(f"{validation} (table {plan['table']['id']}): {len(targets)} arrival points; served within 2%: "
          f"{sum(abs(t[1]) <= 0.02 for t in targets)}, within 3%: {sum(abs(t[1]) <= 0.03 for t in targets)}; "
          f"TTFT p50 within max(10%, spread): {sum(t[4] for t in targets)}")
    for pid, e_s, e_t, spread, ok in targets:
        print(f"  {pid:34s} served {e_s:+.1%}  TTFT p50 {e_t:+.1%} (spread {spread:.0%}) {'ok' if ok else 'MISS'}")
    r = np.array(runs)
    print(f"  each run's summed step time real / price in context: {r.min():.3f}-{r.max():.3f}, within 2%: "
          f"{int((abs(r - 1) <= 0.02).sum())} of {len(r)}")
    for kind, v in sorted(kinds.items()):
        print(f"  median real / price in context, {kind:22s} n={len(v):6d} {np.median(v):.3f}")
    bands = plan.get("intervals", {}).get("bands", {})
    for role in dict.fromkeys(c.point.role for c in results):
        cov = coverage([c for c in results if c.point.role == role], bands)
        if cov["graded"]:
            print(f"  90% bands, {role} points: {cov['inside']} of {cov['graded']} inside ({cov['share']:.1%})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("validations", type=Path, nargs="+")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")  # extrapolation notes about a few long steps; the grading reads every step
    try:
        for v in args.validations:
            if not (v / "plan.json").is_file():
                raise InputError("holds no plan.json", path=v)
            grade(v)
    except InputError as e:
        print(f"grade_validation: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
