"""The engine's host work per step, against another checkout's, measured side by side in one run (CPU).

A step's host work (the scheduler, the runner's inputs and launches, the records) is on the device's critical path
wherever the device waits for it: a prefill or fused step, and a pass's first decode step. On a shared cloud host it
runs up to 2-3x slower for a while (scripts/engine_noise.py), and fresh engines differ in the steps that wait for it
(scripts/instance_spread.py). Here each tree's real engine (its runner, scheduler, step loop and records; the tiny
model on the CPU, its forward passes skipped) serves validation traces on a virtual clock that only the device's
time moves: each launched step moves it on by the step's price in a cost table, so passes batch as they would on the
GPU, and the wall time, less the pricing's own, is the host's work. Of it, `idle_s` is what the device waits for:
the host's work from reading the end of the last step in flight to the next launch. Each (trace, policy) runs in a
fresh process per tree, alternating trees; prints every run's device-idle host time (in all and per step), its whole
host time and its launches' share, and the ratios of the fastest runs (this tree / the other: the least disturbed by
the machine's other work). Both trees must make the same steps (else it says so and fails).

Usage: python scripts/bench_host.py OTHER_TREE [--table T] [--rounds R] [--trace FILE:POLICY ...]
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from servecap.traces.command import Parser, command

HERE = Path(__file__).resolve().parents[1]
TRACES = ("results/validation-v24/traces/mixed512-azure-conv-past.csv:mixed:512",
          "results/validation-v24/traces/chunked512-azure-conv-past.csv:chunked:512",
          "results/validation-v24/traces/packed-sharegpt-past.csv:packed",
          "results/validation-v24/traces/azure-conv-near.csv:padded")
CHILD = """
import json, sys, tempfile, time
from servecap.core.block_pool import PoolSize
from servecap.core.config import ServingConfig
from servecap.core.scheduler import decode_shape
from servecap.costs.model import CostModel
from servecap.costs.table import load_cost_table
from servecap.engine.engine import Engine, EngineConfig
from servecap.engine.model_runner import STRETCH_STEPS
from servecap.traces.records import read_run
from servecap.traces.trace_io import read_trace

trace_file, policy, table = sys.argv[1], sys.argv[2], sys.argv[3]


class DeviceClock:
    # The device's time alone: each launched step moves it on by its price, a wait to its end; the host's work
    # takes none of it, so both trees make the same steps whatever their host speed.
    def __init__(self):
        self.t = 0.0

    def now(self):
        return self.t

    def wait_until(self, t):
        self.t = max(self.t, t)


class Ended:  # a step's end event: the clock has already passed it
    def record(self): pass
    def synchronize(self): pass


engine = Engine(EngineConfig(serving=ServingConfig(model="tiny", max_batch=32, pool=PoolSize(blocks=3000)),
                             device="cpu", max_prompt=4096, max_budget=256), log=lambda *a: None)
r, cost, clock = engine.runner, CostModel(load_cost_table(table)), DeviceClock()
for name in ("_prefill_forward", "_decode_forward", "_advance"):
    setattr(r, name, lambda *a, **k: None)
r.asynchronous, r._ends = True, [Ended() for _ in range(STRETCH_STEPS)]  # the GPU's path: launch ahead, write behind
# The device is idle from the moment the host has read the end of the last step in flight until the next launch;
# the host's work in between is what a step's time holds beyond the device's (the pricing here excluded).
launch, pricing, idle = [0.0], [0.0], [0.0]
in_flight, idle_since = [0], [time.perf_counter()]
prefill, result, decode, step, wait = r.launch_prefill, r.prefill_result, r.launch_decode, r._decode_step, r.wait
stretch = [None]


def launched(t):
    u = time.perf_counter()
    launch[0] += u - t
    if in_flight[0] == 0:
        idle[0] += u - idle_since[0]
    in_flight[0] += 1
    return u


def ended():
    in_flight[0] -= 1
    if in_flight[0] == 0:
        idle_since[0] = time.perf_counter()


def launch_prefill(work):
    t = time.perf_counter(); prefill(work); u = launched(t)
    clock.t += cost.prefill(work.shape)
    pricing[0] += time.perf_counter() - u


def prefill_result():
    tokens = result(); ended()
    return tokens


def launch_decode(rows, backend):
    u = time.perf_counter(); stretch[0] = decode_shape(rows); pricing[0] += time.perf_counter() - u
    idle_since[0] += time.perf_counter() - u
    decode(rows, backend)


def decode_step(j):
    t = time.perf_counter(); step(j); u = launched(t)
    s = stretch[0]
    clock.t += cost.decode("paged", s.rows, s.kv_tokens + j * s.rows, s.kv_max + j)
    pricing[0] += time.perf_counter() - u


def wait_step(j):
    wait(j); ended()


r.launch_prefill, r.prefill_result, r.launch_decode, r._decode_step, r.wait = (launch_prefill, prefill_result,
    launch_decode, decode_step, wait_step)
trace = read_trace(trace_file)
out = tempfile.mkdtemp() + "/run"
w0 = idle_since[0] = time.perf_counter()
engine.run(trace, out, policy=policy, clock=clock, progress=False, telemetry=False, tokens=False)
wall = time.perf_counter() - w0 - pricing[0]
steps = read_run(out).steps
print(json.dumps({"host_s": wall, "idle_s": idle[0], "launch_s": launch[0], "steps": len(steps),
                  "kinds": steps.kind.value_counts().to_dict()}))
"""


def once(tree: Path, trace: str, policy: str, table: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str((HERE / trace).resolve()), policy, str(table)],
                          cwd=tree, env={"PYTHONPATH": str(tree)}, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the run in {tree} failed:\n{done.stderr}")
    return json.loads(done.stdout.splitlines()[-1])


@command("bench_host")
def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("other", type=Path, help="the other checkout (e.g. a `git worktree` of the commit before)")
    p.add_argument("--table", type=Path, default=HERE / "results/calibration/t10/h200-t10-v23.json",
                   help="the cost table whose prices stand for the device's time")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--trace", action="append", metavar="FILE:POLICY", help=f"default: {', '.join(TRACES)}")
    args = p.parse_args(argv)
    trees = {"this": HERE, "other": args.other.resolve()}
    bad = 0
    for spec in args.trace or TRACES:
        if ":" not in spec:
            p.error(f"--trace {spec}: give FILE:POLICY (e.g. traces.csv:chunked:512)")
        trace, policy = spec.split(":", 1)
        runs: dict[str, list[dict]] = {"this": [], "other": []}
        for i in range(args.rounds):
            for name in ("other", "this") if i % 2 == 0 else ("this", "other"):
                r = once(trees[name], trace, policy, args.table.resolve())
                runs[name].append(r)
                print(f"{Path(trace).stem} {policy} round {i + 1} {name:5s}: the device waited {r['idle_s']:.3f} s "
                      f"for the host ({1e6 * r['idle_s'] / r['steps']:.0f} us a step) of its {r['host_s']:.3f} s, "
                      f"launches {r['launch_s']:.3f} s; {r['steps']} steps", flush=True)
        if len({json.dumps(r["kinds"], sort_keys=True) for rs in runs.values() for r in rs}) != 1:
            print(f"{Path(trace).stem} {policy}: the two trees made different steps", file=sys.stderr)
            bad += 1
        best = {k: {m: min(r[m] for r in runs[k]) for m in ("idle_s", "host_s", "launch_s")} for k in runs}
        print(f"{Path(trace).stem} {policy}, this / other: " + ", ".join(
            f"{m} {best['this'][m]:.3f} / {best['other'][m]:.3f} = {best['this'][m] / best['other'][m]:.3f}"
            for m in ("idle_s", "host_s", "launch_s")))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
