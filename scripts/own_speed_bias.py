"""How far the simulator is from the engine when the cost level is exactly right: each run at its own speed.

Each complete run of each point of the validations' plans is simulated at its own speed (its summed step time over
the table's price for its steps in their serving context, as `validate noise` does) and log(measured / simulated)
is taken per metric. Per load (near, past) and prefill policy this prints the mean and the median of that log error
in percent and how many runs are above 0, for TTFT p50, queue wait p50 and served rate. Speed is taken out, so a
mean far from 0 over many runs is what the simulator's scheduling and timing get wrong, or what the runs' speed
within a run does (a run's speed is one number here), not what the step costs get wrong.

    python scripts/own_speed_bias.py --table T DIR [DIR ...]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from pathlib import Path

from servecap.sim.inputs import load_table
from servecap.traces.errors import InputError
from servecap.traces.records import read_run
from servecap.validate.noise import runs_by_point, speed_and_residuals
from servecap.validate.points import load_plan

METRICS = ("ttft_p50", "queue_wait_p50", "served_rate")


def residuals(validation: Path, table) -> list[tuple[str, str, dict]]:
    """(load, prefill policy, log(measured / simulated at its own speed) by metric) for every complete run of
    every arrival point of the validation's plan."""
    points = {p.id: p for p in load_plan(validation)[1]}
    out = []
    for pid, runs in runs_by_point(validation, min_runs=1).items():
        p = points.get(pid)
        if p is None or p.load not in ("near", "past"):
            continue
        _, res, _ = speed_and_residuals(validation, p, [read_run(r) for r in runs], table)
        out += [(p.load, str(p.serving.prefill).partition(":")[0], r) for r in res]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("validations", nargs="+", type=Path, metavar="DIR")
    ap.add_argument("--table", type=Path, required=True, help="the cost table that prices the runs' steps")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    try:
        table = load_table(args.table)
        rows = [r for v in args.validations for r in residuals(v, table)]
    except InputError as e:
        print(f"own_speed_bias: error: {e}", file=sys.stderr)
        return 2
    if not rows:
        print("own_speed_bias: error: no complete run at a near or past point", file=sys.stderr)
        return 2
    print("load  policy    runs | " + " | ".join(f"{m}: mean, median, above 0" for m in METRICS))
    for load in ("near", "past"):
        for policy in sorted({q for l, q, _ in rows if l == load}) + ["all"]:
            group = [r for l, q, r in rows if l == load and policy in (q, "all")]
            if not group:
                continue
            cells = []
            for m in METRICS:
                v = [r[m] for r in group if m in r]
                cells.append(f"{100 * statistics.mean(v):+5.1f}%, {100 * statistics.median(v):+5.1f}%, "
                             f"{sum(x > 0 for x in v):3d} of {len(v)}" if v else "-")
            print(f"{load:5s} {policy:8s} {len(group):5d} | " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
