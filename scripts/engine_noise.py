"""Where a fresh engine's speed goes (GPU): the same work on several freshly started engines, every step's time cut
into host and device time.

Fresh engines on one GPU differ by up to 7% in speed at one validation point (v5, v7), with the SM clock flat. This
script starts engines one after another in this process (as `validate real` does) and on each runs
- a device fingerprint: the 32- and 8-row decode graphs and a 512-token prefill graph replayed back to back, timed
  by CUDA events alone (no host work between replays);
- closed probes (uniform decode, closed mixed under padded and mixed:512);
- serving replays of trace files, as a validation point runs them.
Every step of a probe or replay is timed three ways: the record's duration (start of the pass to the next), the
runner's call (host preparation, launch, device work and the read-back), and the device work alone (CUDA events
around the graph replay or the eager forward). `--gc frozen` freezes the collector's heap and turns collection off
during runs, as vLLM does after start-up. Steps go to OUT/steps.csv (one row per step, appended per run), the
fingerprints to OUT/fingerprint.csv, the run records to OUT/runs/.

Usage: python scripts/engine_noise.py --out DIR [--engines 3] [--gc default|frozen]
                                      [--replay FILE:POLICY ...] [--tag NAME]
"""
from __future__ import annotations

import argparse
import csv
import gc
import sys
import time
from pathlib import Path

import torch

from servecap.core.config import ServingConfig
from servecap.engine.engine import Engine, EngineConfig
from servecap.traces.records import read_run
from servecap.traces.trace_io import read_trace
from servecap.traces.workload import closed_mixed, closed_uniform

STEP_COLUMNS = ("tag", "gc", "engine", "run", "step", "kind", "rows", "tokens", "kv_tokens", "wall_s", "runner_s",
                "prep_s", "device_s")


class Timed:
    """A graph (or the eager forward) whose launches are timed by a pair of CUDA events; `launched` is the host time
    of the last launch."""

    def __init__(self, fn):
        self.fn = fn
        self.e0, self.e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.launched = 0.0

    def replay(self, *args, **kw):
        self.launched = time.perf_counter()
        self.e0.record()
        self.fn(*args, **kw)
        self.e1.record()

    __call__ = replay

    def device_s(self) -> float:
        return self.e0.elapsed_time(self.e1) / 1e3


class TimedRunner:
    """The engine's model runner with every step's call and device work timed (kept in `log`, one tuple a step)."""

    def __init__(self, runner):
        self.inner, self.log = runner, []
        self.last: Timed | None = None
        for graphs in (runner.graphs, runner.prefill_graphs, runner.mixed_graphs):
            for key, g in list(graphs.items()):
                graphs[key] = self._timed(g.replay)
        runner._prefill_forward = self._timed(runner._prefill_forward)

    def _timed(self, fn):
        t = Timed(fn)

        def replay(*args, **kw):
            self.last = t
            t.replay(*args, **kw)
        replay.replay = replay
        return replay

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _call(self, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        t1 = time.perf_counter()
        self.log.append((t1 - t0, self.last.launched - t0, self.last.device_s()))
        return out

    def prefill(self, work):
        return self._call(self.inner.prefill, work)

    def decode(self, rows, backend):
        return self._call(self.inner.decode, rows, backend)


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--engines", type=int, default=3)
    p.add_argument("--gc", choices=("default", "frozen"), default="default")
    p.add_argument("--replay", nargs="*", default=[], metavar="FILE:POLICY")
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    replays = [(Path(s.split(":", 1)[0]), s.split(":", 1)[1]) for s in args.replay]
    traces = {f"{path.stem}-{policy}": (read_trace(path), policy) for path, policy in replays}
    probes = {"uniform-32x2048": (closed_uniform("p2048", 32, 64), "padded"),
              "uniform-8x256": (closed_uniform("p256", 8, 64), "padded"),
              "closed-mixed-padded": (closed_mixed(32, 0), "padded"),
              "closed-mixed-mixed512": (closed_mixed(32, 0), "mixed:512")}
    reqs = [r for t, _ in traces.values() for r in t.requests]
    steps_path, fp_path = args.out / "steps.csv", args.out / "fingerprint.csv"
    new = not steps_path.exists()
    with open(steps_path, "a", newline="") as sf, open(fp_path, "a", newline="") as ff:
        sw, fw = csv.writer(sf), csv.writer(ff)
        if new:
            sw.writerow(STEP_COLUMNS)
            fw.writerow(("tag", "gc", "engine", "name", "device_s"))
        for e in range(args.engines):
            engine = Engine(EngineConfig(ServingConfig(max_batch=32),
                                         max_prompt=max([4096, *(r.prompt_tokens for r in reqs)]),
                                         max_budget=max([256, *(r.budget for r in reqs)])))
            runner = TimedRunner(engine.runner)
            for name, t in fingerprint(engine.runner).items():
                fw.writerow((args.tag, args.gc, e, name, f"{t:.7f}"))
            engine.runner = runner
            runs = [(f"{n}-{k}", tr, pol) for n, (tr, pol) in probes.items() for k in (1, 2)]
            runs += [(n, tr, pol) for n, (tr, pol) in traces.items()]
            for label, trace, policy in runs:
                runner.log.clear()
                d = args.out / "runs" / f"{args.tag}{args.gc}-e{e}-{label}"
                if args.gc == "frozen":
                    gc.collect()
                    gc.freeze()
                    gc.disable()
                try:
                    engine.run(trace, d, "paged", tokens=False, policy=policy, progress=False)
                finally:
                    gc.enable()
                    gc.unfreeze()
                steps = read_run(d).steps.sort_values("step")
                if len(steps) != len(runner.log):
                    print(f"{label}: {len(steps)} steps recorded, {len(runner.log)} timed", file=sys.stderr)
                    continue
                for s, (call, prep, dev) in zip(steps.itertuples(), runner.log):
                    sw.writerow((args.tag, args.gc, e, label, s.step, s.kind, s.rows, s.tokens, s.kv_tokens,
                                 f"{s.end - s.start:.7f}", f"{call:.7f}", f"{prep:.7f}", f"{dev:.7f}"))
                wall = float((steps.end - steps.start).sum())
                dev = sum(x[2] for x in runner.log)
                print(f"{args.tag}{args.gc} engine {e} {label:34s} steps {len(steps):5d} wall {wall:7.3f} s "
                      f"device {dev:7.3f} s host {wall - dev:6.3f} s", flush=True)
                sf.flush()
            engine.runner = runner.inner
            engine.close()
            del engine, runner
    return 0


if __name__ == "__main__":
    sys.exit(main())
