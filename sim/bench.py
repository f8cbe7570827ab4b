"""`python -m sim.bench`: how fast the simulator is, against its speed targets.

Three workloads: one 400-request point (simulated and scored, as a sweep point is), the default sweep (every
default configuration at automatic rates, on 2 worker processes as on the 2-core target machine), and a
100,000-request trace. Events are requests plus steps (prefill and decode) simulated; fast-forward computes
many steps per event-loop pass, so events/s is the rate of modelled engine work, not of SimPy events.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from tqdm import tqdm

from costs.model import CostModel
from costs.synthetic import linear_table
from costs.table import as_cost_table
from traces.errors import InputError
from traces.metrics import served_rate, summary
from traces.workload import poisson_trace

from .inputs import SHIPPED_TABLE, closed, load_table
from .simulator import SimConfig, simulate
from .sweep import Config, Workload, run_sweep

TARGETS_S = {"point": 0.2, "sweep": 10.0, "large": 30.0}
LOAD = 0.7  # the point and the large trace run at this fraction of the estimated capacity: busy but stable


def _line(name: str, wall: float, events: int, target: float) -> str:
    return (f"{name:<28} {wall:8.3f} s  {events:>11,} events  {events / wall:>11,.0f} events/s  "
            f"target <= {target:g} s: {wall / target:.2f}x of it")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sim.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--table", type=Path, help="cost table (default: the shipped H200 table; a synthetic one while "
                                              "that is missing)")
    p.add_argument("--jobs", type=int, default=2, help="worker processes for the sweep (default 2: the target machine)")
    p.add_argument("--large-n", type=int, default=100_000, help="requests in the large trace (default %(default)s)")
    args = p.parse_args(argv)
    try:
        if args.table is None and not SHIPPED_TABLE.exists():
            table, source = as_cost_table(linear_table()), "synthetic linear costs: the shipped H200 table is not there yet"
        else:
            table, source = load_table(args.table, 64), str(args.table or SHIPPED_TABLE)
    except InputError as e:
        print(f"sim.bench: error: {e}", file=sys.stderr)
        return 2
    cost = CostModel(table)
    print(f"sim benchmark: cost table {table.table_id} ({source}); {os.cpu_count()} cores here")
    capacity = served_rate(simulate(closed(poisson_trace(1.0, 400, 0)), cost).record)
    rate = round(LOAD * capacity, 2)
    print(f"paged, max batch 32, pool that never binds; a saturated 400-request run serves {capacity:.2f} req/s, "
          f"so the point and the large trace run at {rate} req/s ({LOAD}x)")

    walls = []
    for _ in range(5):  # the median of 5 after a warm-up: one point is too short to time once
        t0 = time.perf_counter()
        result = simulate(poisson_trace(rate, 400, 0), cost)
        summary(result.record, rate)
        walls.append(time.perf_counter() - t0)
    print(_line("one 400-request point", sorted(walls[1:])[2], result.events, TARGETS_S["point"]))

    configs = [Config(b, m, g) for b in ("paged", "padded") for m in (16, 32) for g in (0.5, 1, 2, 4)]
    t0 = time.perf_counter()
    results, _ = run_sweep(table, configs, None, Workload(), jobs=args.jobs)
    wall = time.perf_counter() - t0
    events = sum(r["sim_events"] for res in results for r in res.rows)
    points = sum(len(res.rows) for res in results)
    print(_line(f"default sweep ({points} points)", wall, events, TARGETS_S["sweep"]) + f" ({args.jobs} processes)")

    trace = poisson_trace(rate, args.large_n, 0)
    t0 = time.perf_counter()
    with tqdm(total=len(trace), unit="req", desc="large trace") as bar:
        result = simulate(trace, cost, SimConfig(), on_finish=bar.update)
    summary(result.record, rate)
    print(_line(f"{args.large_n:,}-request trace", time.perf_counter() - t0, result.events, TARGETS_S["large"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
