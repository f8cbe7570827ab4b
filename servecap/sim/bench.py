"""`python -m sim.bench`: how fast the simulator is, against its speed targets.

Workloads: one 400-request point (simulated and scored, as a sweep point is), the default sweep (every default
configuration at automatic rates, on 2 worker processes as on the 2-core target machine), a 100,000-request
trace, and a 1,000,000-request one (in a child process, for its peak memory; --quick skips it); and two whole
commands, `python -m sim run --help` and `python -m sim run --rate R` for one 400-request point, timed from
process start. Events are requests plus steps (prefill and decode) simulated; fast-forward computes many steps
per event-loop pass, so events/s is the rate of modelled engine work, not of SimPy events.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

from servecap.costs.model import CostModel
from servecap.costs.synthetic import linear_table
from servecap.core.block_pool import PoolSize
from servecap.core.config import ServingConfig
from servecap.costs.table import as_cost_table
from servecap.traces.arg_types import count_arg, requests_arg
from servecap.traces.command import Parser, command
from servecap.traces.metrics import served_rate, summary
from servecap.traces.workload import poisson_trace

from .inputs import SHIPPED_TABLE, closed, load_table
from .simulator import SimConfig, simulate
from .sweep import Workload, run_sweep

TARGETS_S = {"point": 0.2, "sweep": 3.5, "large": 3.0, "million": 35.0, "help": 0.4, "command": 0.4}
MILLION_PEAK_GB = 1.0  # 10**9 bytes
LOAD = 0.7  # the point and the large traces run at this fraction of the estimated capacity: busy but stable
COMMAND_REPEATS = 5
REPO = Path(__file__).resolve().parents[2]


def _line(name: str, wall: float, events: int, target: float) -> str:
    return (f"{name:<28} {wall:8.3f} s  {events:>11,} events  {events / wall:>11,.0f} events/s  "
            f"target <= {target:g} s: {wall / target:.2f}x of it")


def _command_line(name: str, walls: list[float], target: float) -> str:
    wall = statistics.median(walls)
    return (f"{name:<28} {wall:8.3f} s  median of {len(walls)} runs, process start included (min {min(walls):.3f} s)"
            f"  target <= {target:g} s: {wall / target:.2f}x of it")


def _timed_command(argv: list[str]) -> list[float]:
    """Wall seconds of `python -m sim ARGV`, run COMMAND_REPEATS times from the repository root."""
    walls = []
    for _ in range(COMMAND_REPEATS):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "sim", *argv], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        walls.append(time.perf_counter() - t0)
    return walls


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def large_run(table_path: str | None, n: int, rate: float) -> dict:
    """One n-request trace simulated and scored, as the large lines time it; run in a child process (--child-large)
    so that its peak memory is its own. Bytes per request: the peak resident memory less what the process held
    before the trace was made (interpreter, imports, cost table)."""
    table = as_cost_table(linear_table()) if table_path == "synthetic" else load_table(table_path)
    cost = CostModel(table)
    simulate(poisson_trace(rate, 400, 0), cost)  # the cost model's lookups filled, as in a long-lived worker
    before = _rss_bytes()
    trace = poisson_trace(rate, n, 0)
    t0 = time.perf_counter()
    result = simulate(trace, cost)
    summary(result.record, rate)
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {"wall_s": wall, "events": result.events, "peak_bytes": peak, "bytes_per_request": (peak - before) / n}


@command("sim.bench")
def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m sim.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--table", type=Path, help="cost table (default: the shipped H200 table; a synthetic one while "
                                              "that is missing)")
    p.add_argument("--jobs", type=count_arg, default=2, help="worker processes for the sweep (default 2: the target machine)")
    p.add_argument("--large-n", type=requests_arg, default=100_000, help="requests in the large trace (default %(default)s)")
    p.add_argument("--million-n", type=requests_arg, default=1_000_000,
                   help="requests in the largest trace, run in a child process (default %(default)s)")
    p.add_argument("--quick", action="store_true", help="skip the largest trace")
    p.add_argument("--child-large", nargs=3, metavar=("TABLE", "N", "RATE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_large:
        table_path, n, rate = args.child_large
        print(json.dumps(large_run(None if table_path == "shipped" else table_path, int(n), float(rate))))
        return 0
    if args.table is None and not SHIPPED_TABLE.exists():
        table, source = as_cost_table(linear_table()), "synthetic linear costs: the shipped H200 table is not there yet"
    else:
        table, source = load_table(args.table), str(args.table or SHIPPED_TABLE)
    cost = CostModel(table)
    print(f"sim benchmark: cost table {table.table_id} ({source}); {os.cpu_count()} cores here")
    capacity = served_rate(simulate(closed(poisson_trace(1.0, 400, 0)), cost).record)
    rate = round(LOAD * capacity, 2)
    print(f"paged, max batch 32, pool that never binds; a saturated 400-request run serves {capacity:.2f} req/s, "
          f"so the point and the large traces run at {rate} req/s ({LOAD}x)")
    table_arg = [] if args.table is None else ["--table", str(args.table.resolve())]

    print(_command_line("sim run --help", _timed_command(["run", "--help"]), TARGETS_S["help"]))
    if args.table is not None or SHIPPED_TABLE.exists():  # the command reads a table file
        print(_command_line("sim run, one 400-request pt", _timed_command(["run", "--rate", str(rate), *table_arg]),
                            TARGETS_S["command"]))

    walls = []
    for _ in range(5):  # the median of 5 after a warm-up: one point is too short to time once
        t0 = time.perf_counter()
        result = simulate(poisson_trace(rate, 400, 0), cost)
        summary(result.record, rate)
        walls.append(time.perf_counter() - t0)
    print(_line("one 400-request point", sorted(walls[1:])[2], result.events, TARGETS_S["point"]))

    configs = [ServingConfig(backend=b, max_batch=m, pool=PoolSize(gib=g)) for b in table.backends for m in (16, 32)
               for g in (0.5, 1, 2, 4)]
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

    if not args.quick:
        child = args.table.resolve() if args.table else "shipped" if SHIPPED_TABLE.exists() else "synthetic"
        out = subprocess.run([sys.executable, "-m", "servecap.sim.bench", "--child-large", str(child), str(args.million_n),
                              str(rate)], cwd=REPO, check=True, capture_output=True, text=True).stdout
        m = json.loads(out.splitlines()[-1])
        n = args.million_n
        print(_line(f"{n:,}-request trace", m["wall_s"], m["events"], TARGETS_S["million"]) +
              f"; peak memory {m['peak_bytes'] / 1e9:.2f} GB (target <= {MILLION_PEAK_GB:g} GB: "
              f"{m['peak_bytes'] / 1e9 / MILLION_PEAK_GB:.2f}x of it); {m['wall_s'] / n * 1e6:.1f} us and "
              f"{m['bytes_per_request']:,.0f} bytes a request")
    return 0


if __name__ == "__main__":
    sys.exit(main())
