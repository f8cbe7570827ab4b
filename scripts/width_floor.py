"""How narrow a prediction band can be against the real repeats' spread, with no error of its own.

#21 asks a 90% band's width to stay within twice the real spread (max - min) of a point's repeats. A point's real
runs differ by run-to-run noise: log speed sd s_run (run_to_run.json, the pooled arrival speed). A band for one real
run must also hold how far the prediction is from that GPU's runs, the cost model's error and the GPU's offset:
in all s_cost (the table's sigma_cost, servecap/sim/intervals.py; a corrected table's held-out run residual holds
s_run too). A band exactly as wide as that, W = 2 z s_cost in log space (z at the level's edge), against the range
of n repeats, R = s_run * range_n (range_n the range of n standard normals), is within 2x where
range_n >= z s_cost / s_run. For a metric monotone in speed, band and spread scale by the same slope to first order,
so this holds for served rate and wall time exactly and for TTFT and queue waits approximately.

The range of n standard normals has P(range_n <= r) = n * integral phi(x) (Phi(x + r) - Phi(x))^(n - 1) dx. Prints,
for each number of repeats, the share of points whose band is within 2x the spread and the median ratio: for a band
that knew the GPU's offset and the cost exactly (s_cost = s_run), and for the table's s_cost.

    python scripts/width_floor.py --table T [--noise FILE] [--level 90] [--repeats 3,5,10]
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

from scipy import integrate, optimize, stats

from servecap.sim.inputs import load_table
from servecap.sim.intervals import NOISE, cost_sigma, load_noise, z_level
from servecap.traces.command import Parser, command
from servecap.traces.errors import InputError


def range_cdf(r: float, n: int) -> float:
    """P(range of n iid standard normals <= r)."""
    if r <= 0:
        return 0.0
    f = lambda x: stats.norm.pdf(x) * (stats.norm.cdf(x + r) - stats.norm.cdf(x)) ** (n - 1)  # noqa: E731
    return min(1.0, n * integrate.quad(f, -math.inf, math.inf)[0])


def within_2x(ratio: float, n: int) -> float:
    """The share of points whose band of width `ratio` run-noise sds, W / s_run, is within 2x the range of n
    repeats: P(range_n >= ratio / 2)."""
    return 1.0 - range_cdf(ratio / 2, n)


def median_ratio(ratio: float, n: int) -> float:
    """The median over points of W / R: the band's width over the median range of n repeats."""
    return ratio / optimize.brentq(lambda r: range_cdf(r, n) - 0.5, 1e-6, 20.0)


@command("width_floor")
def main(argv: list[str] | None = None) -> int:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", type=Path, required=True, help="the cost table whose bands are weighed")
    ap.add_argument("--noise", type=Path, default=NOISE, help="a run-to-run noise file (default: the shipped one)")
    ap.add_argument("--level", type=float, default=90.0, help="the band's level, percent (default 90)")
    ap.add_argument("--repeats", default="3,5,10", help="numbers of repeats a point has (default 3,5,10)")
    args = ap.parse_args(argv)
    try:
        repeats = [int(n) for n in args.repeats.split(",")]
        if not 0 < args.level < 100 or min(repeats) < 2:
            raise ValueError
    except ValueError:
        raise InputError(f"--level must be in (0, 100) and --repeats integers of 2 or more (got {args.level:g}, "
                         f"{args.repeats!r})") from None
    noise = load_noise(args.noise)
    table = load_table(args.table)
    speed = noise["pooled"]["arrival"]["speed"]
    s_run, s_cost, z = speed["sigma"], cost_sigma(table, noise)["sigma"], z_level(args.level)
    print(f"run-to-run speed sd {s_run:.2%} ({speed['runs']} runs at {speed['groups']} points); the table's "
          f"sigma_cost {s_cost:.2%} ({table.table_id}); {args.level:g}% band: z = {z:.3f}")
    print("repeats | band for run noise alone: within 2x, median ratio | band with the table's sigma_cost: "
          "within 2x, median ratio")
    for n in repeats:
        alone, table_band = 2 * z, 2 * z * s_cost / s_run
        print(f"{n:7d} | {within_2x(alone, n):6.1%}, {median_ratio(alone, n):.2f}x | "
              f"{within_2x(table_band, n):6.1%}, {median_ratio(table_band, n):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
