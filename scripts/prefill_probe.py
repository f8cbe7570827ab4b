"""Where a serving prefill step's time goes (GPU), against the length of the decode stretch before it.

Validation v11's side-by-side check found that a prefill step costs about 10 us more for each step of the decode
stretch before it, also with the engine writing that stretch's records while the prefill runs. This replays a trace
on a fresh engine with every prefill step cut into phases, on the host's clock and the device's:
- sched: from the step's start (the last pass's end) to the timer's prefill call (arrivals, the scheduler);
- prep: the runner building the step's inputs, up to its graph's launch;
- launch: the graph's launch call;
- behind: the host work done while the step runs (writing the last pass's records);
- wait: from there until the step's tokens are on the host;
- device: the graph's own time on the device (a CUDA event each side), and idle: the device's wait from the
  step's start to the graph's first kernel.
Rows go to OUT/prefill.csv; the summary prints each phase's median and its slope on the stretch's length (least
squares, us per step). `--ids-ahead` alternates runs on one engine: the prompts' ids made inside the prefill step,
as the engine does, and made before the run, and prints each run's busy time beside the other's.

Usage: python scripts/prefill_probe.py --trace FILE --policy POLICY --out DIR [--engines 1] [--ids-ahead]
"""
from __future__ import annotations

import csv
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from servecap.core.config import ServingConfig
from servecap.engine import serve
from servecap.engine.engine import Engine, EngineConfig
from servecap.engine.model_runner import _prompt_ids
from servecap.traces.command import Parser, command
from servecap.traces.trace_io import read_trace

PHASES = ("sched", "prep", "launch", "behind", "wait", "device", "idle")


class Probe:
    """EngineTimer's prefill and decode, timed by phase (a subclass's methods, patched in for the run)."""

    def __init__(self):
        self.rows: list[dict] = []
        self.last_k = 0  # steps in the last decode stretch
        self.replay: tuple | None = None  # the last graph replay's host times and events (_Timed)

    @contextmanager
    def installed(self, runner):
        """The runner's prefill graphs and the engine's timer timed for one run, both put back after it (so a
        later run on the same engine is timed once, not through every earlier run's wrappers)."""
        originals = [dict(graphs) for graphs in (runner.prefill_graphs, runner.mixed_graphs)]
        for graphs in (runner.prefill_graphs, runner.mixed_graphs):
            for key, g in list(graphs.items()):
                graphs[key] = _Timed(g, self)
        base = serve.EngineTimer
        serve.EngineTimer = self._timer(base)
        try:
            yield
        finally:
            serve.EngineTimer = base
            for graphs, kept in zip((runner.prefill_graphs, runner.mixed_graphs), originals):
                graphs.update(kept)

    def _timer(self, base: type) -> type:
        probe = self

        class Timer(base):
            def prefill(self, work, start, then):  # the decode step after it is launched by decode(), as before
                clock, r = self.clock, self.runner
                t_call = clock.now()
                e_call = torch.cuda.Event(enable_timing=True)
                e_call.record()
                probe.replay = None
                r.launch_prefill(work)
                t_launched = clock.now()
                self.while_running()
                t_behind = clock.now()
                tokens = r.prefill_result()
                end = clock.now()
                if probe.replay is None:  # an eager step: no graph
                    t_replay = t_replayed = t_launched
                    e_a = e_b = None
                else:  # perf_counter's times, on the run's clock
                    t_replay, t_replayed, e_a, e_b = probe.replay
                    t_replay, t_replayed = t_replay - clock.t0, t_replayed - clock.t0
                probe.rows.append({"start": start, "tokens": sum(work.computed), "seqs": len(work.seqs),
                                   "decode_rows": work.decode, "prev_k": probe.last_k,
                                   "sched": t_call - start, "prep": t_replay - t_call,
                                   "launch": t_replayed - t_replay, "behind": t_behind - t_launched,
                                   "wait": end - t_behind, "total": end - start, "_ev": (e_call, e_a, e_b)})
                probe.last_k = 0
                return tokens, end

            def decode(self, rows, shape, start, limit, stop):
                tokens, ends = super().decode(rows, shape, start, limit, stop)
                probe.last_k = len(ends)
                return tokens, ends

        return Timer

    def resolve(self) -> None:
        torch.cuda.synchronize()
        for row in self.rows:
            e_call, e_a, e_b = row.pop("_ev")
            row["device"] = e_a.elapsed_time(e_b) / 1e3 if e_a is not None else float("nan")
            row["idle"] = e_call.elapsed_time(e_a) / 1e3 if e_a is not None else float("nan")


class _Timed:
    """A captured graph whose replay is timed on both clocks."""

    def __init__(self, graph, probe: Probe):
        self.graph, self.probe = graph, probe

    def replay(self) -> None:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        self.graph.replay()
        b.record()
        t1 = time.perf_counter()
        self.probe.replay = (t0, t1, a, b)


@command("prefill_probe")
def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, required=True)
    p.add_argument("--policy", default="padded")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--ids-ahead", action="store_true",
                   help="alternate each run with one whose prompts' ids were made before it (as a frontend that "
                        "tokenizes on arrival would), side by side on the same engine")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    trace = read_trace(args.trace)
    modes = ("in-step", "ahead", "in-step", "ahead") if args.ids_ahead else ("in-step",)
    rows, runs = [], []
    for e in range(args.engines):
        engine = Engine(EngineConfig(ServingConfig(max_batch=32),
                                     max_prompt=max([4096, *(r.prompt_tokens for r in trace.requests)]),
                                     max_budget=max([256, *(r.budget for r in trace.requests)])))
        for i, mode in enumerate(modes):
            _prompt_ids.cache_clear()
            if mode == "ahead":
                for r in trace.requests:
                    _prompt_ids(r, engine.runner.model.vocab)
            probe = Probe()
            with probe.installed(engine.runner):
                rec = engine.run(trace, args.out / f"run-{e}-{i}-{mode}", "paged", tokens=False, policy=args.policy,
                                 progress=False)
            probe.resolve()
            for r in probe.rows:
                r["engine"], r["mode"] = e, mode
            rows += probe.rows
            busy = float((rec.steps.end - rec.steps.start).sum())
            runs.append((e, mode, busy))
            print(f"engine {e} run {i} ({mode}): busy {busy:.3f} s, {len(probe.rows)} prefill steps")
        engine.close()
    keys = ["engine", "mode", "start", "tokens", "seqs", "decode_rows", "prev_k", *PHASES, "total"]
    with open(args.out / "prefill.csv", "w", newline="") as f:
        w = csv.DictWriter(f, keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    for mode in dict.fromkeys(modes):
        mine = [r for r in rows if r["mode"] == mode]
        k = np.array([r["prev_k"] for r in mine], float)
        after = k > 0
        busy = [b for _, m, b in runs if m == mode]
        print(f"{mode}: {len(mine)} prefill steps, {int(after.sum())} after a decode stretch (its length: median "
              f"{np.median(k[after]):.0f}, max {k.max():.0f}); busy {', '.join(f'{b:.3f}' for b in busy)} s")
        for name in (*PHASES, "total"):
            v = np.array([r[name] for r in mine], float)[after]
            ok = np.isfinite(v)
            if ok.sum() < 3:  # the device's phases of eager steps: no graph was timed
                continue
            slope = np.polyfit(k[after][ok], v[ok], 1)[0]
            print(f"  {name:7s} median {np.median(v[ok]) * 1e6:8.1f} us   slope {slope * 1e6:6.2f} us per stretch step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
