"""The simulator's speed against another checkout's, measured side by side in one run: a 100k-request trace
(sim.bench's large trace: paged, 32 rows, a pool that never binds, at 0.8x capacity) simulated by each tree in
turn, alternating, each in a fresh process; prints the CPU and wall seconds of every run and the ratios of the
medians (this tree / the other). Usage: python scripts/bench_side_by_side.py OTHER_TREE [--n N] [--rounds R]"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from servecap.traces.command import Parser, command

HERE = Path(__file__).resolve().parents[1]
# {p}: the packages' prefix in the tree measured ("servecap." since the namespace move, none before it)
CHILD = """
import json, sys, time
from {p}costs.model import CostModel
from {p}costs.table import load_cost_table
from {p}sim.bench import LOAD
from {p}sim.inputs import SHIPPED_TABLE, closed
from {p}sim.simulator import simulate
from {p}traces.metrics import served_rate
from {p}traces.workload import poisson_trace
cost = CostModel(load_cost_table(SHIPPED_TABLE))
rate = round(LOAD * served_rate(simulate(closed(poisson_trace(1.0, 400, 0)), cost).record), 2)
trace = poisson_trace(rate, int(sys.argv[1]), 0)
simulate(poisson_trace(rate, 2000, 1), cost)  # the cost model's caches warmed, as in any sweep worker
w0, c0 = time.perf_counter(), time.process_time()
r = simulate(trace, cost)
print(json.dumps({"wall_s": time.perf_counter() - w0, "cpu_s": time.process_time() - c0, "events": r.events,
                  "finished_last": float(r.record.requests.finished.max())}))
"""


def once(tree: Path, n: int) -> dict:
    code = CHILD.replace("{p}", "servecap." if (tree / "servecap" / "sim").is_dir() else "")
    done = subprocess.run([sys.executable, "-c", code, str(n)], cwd=tree, env={"PYTHONPATH": str(tree)},
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the run in {tree} failed:\n{done.stderr}")
    return json.loads(done.stdout.splitlines()[-1])


@command("bench_side_by_side")
def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__)
    p.add_argument("other", type=Path)
    p.add_argument("--n", type=int, default=100_000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    runs: dict[str, list[dict]] = {"this": [], "other": []}
    for i in range(args.rounds):
        for name, tree in (("other", args.other.resolve()), ("this", HERE)) if i % 2 == 0 else \
                (("this", HERE), ("other", args.other.resolve())):
            r = once(tree, args.n)
            runs[name].append(r)
            print(f"round {i + 1} {name:5s}: cpu {r['cpu_s']:.2f} s, wall {r['wall_s']:.2f} s, {r['events']:,} events",
                  flush=True)
    if {json.dumps({k: r[k] for k in ("events", "finished_last")}) for rs in runs.values() for r in rs}.__len__() != 1:
        print("the two trees simulated different runs", file=sys.stderr)
        return 1
    for key in ("cpu_s", "wall_s"):
        a, b = (statistics.median(r[key] for r in runs[k]) for k in ("this", "other"))
        print(f"{key}: this {a:.2f}, other {b:.2f}, ratio this/other {a / b:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
