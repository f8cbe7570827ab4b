"""Where a fresh engine's time goes (GPU): the same work on several freshly started engines, each run's busy time cut
into the device's work and the host's.

Fresh engines on one GPU differed by up to 7% in speed at one validation point (v5, v7), with the SM clock flat.
This script starts engines one after another in this process (as `validate real` does) and on each runs
- a device fingerprint: the 32- and 8-row decode graphs and a 512-token prefill graph replayed back to back, timed
  by CUDA events alone (no host work between replays);
- closed probes (uniform decode, closed mixed under padded and mixed:512), twice each;
- serving replays of trace files, as a validation point runs them.
Every graph replay and eager forward is timed by a pair of CUDA events: a run's device time is their sum, its
busy time the sum of its recorded steps, and the host's share what is left (work between steps that the device
waits for). `--gc frozen` freezes the collector's heap and turns collection off during runs, as vLLM does after
start-up. Runs go to OUT/runs.csv (a row per run, appended), fingerprints to OUT/fingerprint.csv, the run records
to OUT/runs/.

Usage: python scripts/engine_noise.py --out DIR [--engines 3] [--gc default|frozen] [--probes]
                                      [--replay FILE:POLICY ...] [--tag NAME]
"""
from __future__ import annotations

import csv
import gc
import sys
from pathlib import Path

import torch

from servecap.core.config import ServingConfig
from servecap.engine.engine import Engine, EngineConfig
from servecap.traces.command import Parser, command
from servecap.traces.records import read_run
from servecap.traces.trace_io import read_trace
from servecap.traces.workload import closed_mixed, closed_uniform

RUN_COLUMNS = ("tag", "gc", "engine", "run", "steps", "busy_s", "device_s", "host_s")
EAGER = ("_prefill_forward", "_decode_forward", "_advance", "_feed")  # the runner's device work outside its graphs


class DeviceTime:
    """Every graph replay and eager forward of a model runner timed by a pair of CUDA events (kept until read)."""

    def __init__(self, runner):
        self.pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        for graphs in (runner.graphs, runner.prefill_graphs, runner.mixed_graphs,
                       getattr(runner, "advance_graphs", {})):
            for key, g in list(graphs.items()):
                graphs[key] = self._timed(g.replay)
        for name in EAGER:
            if hasattr(runner, name):
                setattr(runner, name, self._timed(getattr(runner, name)))

    def _timed(self, fn):
        def replay(*args, **kw):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn(*args, **kw)
            b.record()
            self.pairs.append((a, b))
        replay.replay = replay
        return replay

    def take(self) -> float:
        """Seconds of device work since the last take."""
        torch.cuda.synchronize()
        s = sum(a.elapsed_time(b) for a, b in self.pairs) / 1e3
        self.pairs.clear()
        return s


def fingerprint(runner, reps: int = 200) -> dict:
    """Median device time of back-to-back replays of a few captured graphs: the engine's device speed, no host."""
    out = {}
    for name, g in (("decode32", runner.graphs.get(("paged", 32))), ("decode8", runner.graphs.get(("paged", 8))),
                    ("prefill512", runner.prefill_graphs.get(512))):
        if g is None:
            continue
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for a, b in ev:
            a.record()
            g.replay()
            b.record()
        torch.cuda.synchronize()
        times = sorted(a.elapsed_time(b) / 1e3 for a, b in ev)
        out[name] = times[len(times) // 2]
    return out


@command("engine_noise")
def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--engines", type=int, default=3)
    p.add_argument("--gc", choices=("default", "frozen"), default="default")
    p.add_argument("--probes", action="store_true", help="the closed probes too")
    p.add_argument("--replay", nargs="*", default=[], metavar="FILE:POLICY")
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    replays = [(Path(s.split(":", 1)[0]), s.split(":", 1)[1]) for s in args.replay]
    traces = {f"{path.stem}-{policy}": (read_trace(path), policy) for path, policy in replays}
    probes = {"uniform-32x2048": (closed_uniform("p2048", 32, 64), "padded"),
              "uniform-8x256": (closed_uniform("p256", 8, 64), "padded"),
              "closed-mixed-padded": (closed_mixed(32, 0), "padded"),
              "closed-mixed-mixed512": (closed_mixed(32, 0), "mixed:512")} if args.probes else {}
    reqs = [r for t, _ in traces.values() for r in t.requests]
    runs_path, fp_path = args.out / "runs.csv", args.out / "fingerprint.csv"
    new = not runs_path.exists()
    with open(runs_path, "a", newline="") as rf, open(fp_path, "a", newline="") as ff:
        rw, fw = csv.writer(rf), csv.writer(ff)
        if new:
            rw.writerow(RUN_COLUMNS)
            fw.writerow(("tag", "gc", "engine", "name", "device_s"))
        for e in range(args.engines):
            engine = Engine(EngineConfig(ServingConfig(max_batch=32),
                                         max_prompt=max([4096, *(r.prompt_tokens for r in reqs)]),
                                         max_budget=max([256, *(r.budget for r in reqs)])))
            for name, t in fingerprint(engine.runner).items():
                fw.writerow((args.tag, args.gc, e, name, f"{t:.7f}"))
            timed = DeviceTime(engine.runner)
            runs = [(f"{n}-{k}", tr, pol) for n, (tr, pol) in probes.items() for k in (1, 2)]
            runs += [(n, tr, pol) for n, (tr, pol) in traces.items()]
            for label, trace, policy in runs:
                d = args.out / "runs" / f"{args.tag}{args.gc}-e{e}-{label}"
                timed.take()
                if args.gc == "frozen":
                    gc.collect()
                    gc.freeze()
                    gc.disable()
                try:
                    engine.run(trace, d, "paged", tokens=False, policy=policy, progress=False)
                finally:
                    gc.enable()
                    gc.unfreeze()
                device = timed.take()
                steps = read_run(d).steps
                busy = float((steps.end - steps.start).sum())
                rw.writerow((args.tag, args.gc, e, label, len(steps), f"{busy:.6f}", f"{device:.6f}",
                             f"{busy - device:.6f}"))
                rf.flush()
                print(f"{args.tag}{args.gc} engine {e} {label:34s} steps {len(steps):5d} busy {busy:7.3f} s "
                      f"device {device:7.3f} s host {busy - device:6.3f} s ({(busy - device) / busy:5.1%})",
                      flush=True)
            engine.close()
            del engine, timed
    return 0


if __name__ == "__main__":
    sys.exit(main())
