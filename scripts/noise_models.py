"""Which model of the run-to-run noise beyond speed predicts repeats it did not see: a noise file's groups, each
validation left out in turn, scored by the chi-squared likelihood of its groups' sample variances.

- loads: the sd below and past capacity, pooled from the other validations' groups by the simulator's verdict
  (majority), mixed by the group's share of runs stable (the intervals' rule before the slope fit);
- slope: sqrt(a^2 + (p k_stable^2 + (1 - p) k_unstable^2) x^2), x the group's speed slope (servecap/validate/noise.py
  slope_fit, fitted on the other validations' groups).

Prints, per metric, each model's negative log-likelihood summed over the held-out groups (lower is better; the
difference is a log likelihood ratio) and the median of each group's sample sd over the sd predicted for it.

    python scripts/noise_models.py [NOISE_JSON]   (default: the shipped servecap/costs/data/run_to_run.json)
"""
from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

from servecap.sim.intervals import NOISE, load_noise, noise_sigma
from servecap.traces.command import Parser, command
from servecap.traces.errors import InputError
from servecap.validate.noise import METRICS, _pool, _residuals, slope_fit


def loads_fit(groups: list[dict], metric: str) -> dict:
    """The `arrival-stable` and `arrival-unstable` pools of `metric` over `groups`, as noise.measure pools them."""
    out = {}
    for load in ("stable", "unstable"):
        mine = [g for g in groups if (sum(g["sim_stable"]) * 2 > len(g["sim_stable"])) == (load == "stable")]
        res = _residuals(mine, metric)
        if res:
            out[f"arrival-{load}"] = {metric: {"residual_sigma": _pool(res)["sigma"]}}
    return out


def nll(sd: float, s: float, dof: int) -> float:
    """-log of the chi-squared likelihood of a sample sd s over dof degrees of freedom under sd (less constants)."""
    return dof / 2 * (s * s / (sd * sd) + math.log(sd * sd))


@command("noise_models")
def main(argv: list[str] | None = None) -> int:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("noise", type=Path, nargs="?", default=NOISE, help="a noise file measured with --table")
    args = ap.parse_args(argv)
    groups = [g for g in load_noise(args.noise)["groups"]
              if g["regime"] == "arrival" and "slopes" in g and "sim_stable" in g]
    validations = sorted({g["validation"] for g in groups})
    if len(validations) < 2:
        raise InputError("needs groups with speed slopes from two or more validations (validate noise --table, "
                         "since the slope fit)", path=args.noise)
    print(f"{args.noise}: {len(groups)} repeated arrival points in {len(validations)} validations, each validation "
          "held out in turn")
    print(f"{'metric':15s} {'groups':>6s} | NLL loads  slope  (loads - slope) | median sample / predicted sd: "
          "loads  slope")
    for metric in METRICS:
        score = {"loads": [0.0, []], "slope": [0.0, []]}
        n = 0
        for v in validations:
            train = [g for g in groups if g["validation"] != v]
            test = [g for g in groups if g["validation"] == v and metric in g["residual_log_sd"]]
            fits = {"loads": loads_fit(train, metric), "slope": {}}
            slope = slope_fit(train, metric)
            if slope is None or not test:
                continue
            fits["slope"] = {"arrival-slope": {metric: slope}}
            for g in test:
                p = sum(g["sim_stable"]) / len(g["sim_stable"])
                s, dof = g["residual_log_sd"][metric], len(g["speed"]) - 1
                for name, pooled in fits.items():
                    sd = noise_sigma(pooled, metric, False, p, g["slopes"].get(metric))
                    score[name][0] += nll(sd, s, dof)
                    score[name][1].append(s / sd)
                n += 1
        if n:
            (a, ra), (b, rb) = score["loads"], score["slope"]
            print(f"{metric:15s} {n:6d} | {a:9.1f} {b:6.1f} {a - b:+8.1f}         | "
                  f"{statistics.median(ra):31.2f} {statistics.median(rb):6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
