"""A measured run's cost-table points: prefill repetitions and decode step windows, as median and spread.

A decode run's steps are used without the first SETTLE_S seconds after its prefill and without its last step
(where every row retires; that step measures the overhead instead). After a large prefill the GPU runs decode
steps slower for a short while before they settle, while an engine serving arrivals spends nearly all its steps
settled; a table built from the transient predicts serving steps too slow.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from servecap.costs.shapes import PrefillShape, kv_read
from servecap.core.block_pool import unbounded_pool
from servecap.core.scheduler import PrefillWork
from servecap.core.step_loop import StepLoop, TraceArrivals, drive
from servecap.traces.workload import Request

from .plan import Run

SETTLE_S = 0.1
MIN_STEPS = 3


def stats(durations) -> dict:
    d = np.asarray(durations, float)
    p10, med, p90 = np.percentile(d, [10, 50, 90])
    return {"median_s": float(med), "p10_s": float(p10), "p90_s": float(p90), "n": int(d.size)}


class _ReplayTimer:
    """The step loop's timer for a closed run replayed off the GPU: unit step times (a closed run's steps do not
    depend on when they end), keeping every prefill or fused step's shape in order."""

    fast_forward = False

    def __init__(self):
        self.t, self.shapes = 0.0, []

    def now(self) -> float:
        return self.t

    def wait_until(self, t: float) -> None:
        self.t = max(self.t, t)

    def prefill(self, work: PrefillWork, start: float, then) -> tuple[None, float]:
        self.shapes.append(work.shape)
        self.t = start + 1.0
        return None, self.t

    def decode(self, rows, shape, start: float, limit: int, stop: float) -> tuple[None, list[float]]:
        self.t = start + 1.0
        return None, [self.t]

    def retired(self, n: int) -> None:
        pass

    def stretch_ended(self, steps: int) -> float:
        return 0.0


class _NoLog:
    """A run log that keeps nothing: the replay wants the shapes only."""

    tokens = keep_decode = False

    def prefill(self, *args) -> None:
        pass

    def decode_steps(self, *args) -> None:
        pass

    def finish(self, seqs) -> None:
        pass

    def reject(self, req: Request, reason: str) -> None:
        raise ValueError(f"a calibration run's request was refused: {reason}")


def step_shapes(run: Run) -> list[PrefillShape]:
    """The prefill (and fused) steps the engine's scheduler and step loop make of a closed run, in order (several
    for a chunked prompt; a fused run's steps hold its decode rows): the same code replayed here, so a measured
    duration gets its exact step."""
    serving = run.serving
    pool = unbounded_pool(run.width, max(run.prompts) + run.budget, serving.block_size)
    timer = _ReplayTimer()
    requests = [Request(i, 0.0, n, run.budget) for i, n in enumerate(run.prompts)]
    drive(StepLoop(serving.scheduler(pool, None, run.width), _NoLog(), timer, TraceArrivals(requests)), timer)
    return timer.shapes


def prefill_steps(run: Run, sample: dict) -> dict[PrefillShape, list[float]]:
    """Every prefill step of a run's repetitions, by shape: its durations."""
    shapes = step_shapes(run)
    by_shape: dict[PrefillShape, list[float]] = defaultdict(list)
    for rep in sample["prefill"]:
        if [(s.rows, s.tokens, s.attn) for s in shapes] != [tuple(x[:3]) for x in rep]:
            raise ValueError(f"{run.label}: the measured steps {[x[:3] for x in rep]} are not the scheduler's "
                             f"{[(s.rows, s.tokens, s.attn) for s in shapes]}")
        for shape, step in zip(shapes, rep):
            by_shape[shape].append(step[3])
    return by_shape


def prefill_points(run: Run, sample: dict) -> list[dict]:
    """One point per distinct step shape of the run (a chunked prompt's chunks are several)."""
    policy = run.policy.partition(":")[0]
    return [{"policy": policy, "rows": s.rows, "tokens": s.tokens, "attn": s.attn, "computed": list(s.computed),
             "prefix": list(s.prefix), **({"decode": s.decode} if s.decode else {}), **stats(d), "run": run.label}
            for s, d in prefill_steps(run, sample).items()]


def first_over_again(run: Run, sample: dict) -> float:
    """A stationarity run's first-run time over the median of its repeats (prefill: the run's prefill steps
    summed; decode: the median step)."""
    if run.kind == "stationary-decode":
        return float(np.median(sample["first"]) / np.median(sample["again"]))
    totals = [sum(s[3] for s in rep) for rep in sample["prefill"]]
    return float(totals[0] / np.median(totals[1:]))


def usable_steps(sample: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """K/V tokens (all rows, longest row) and duration of the decode steps that make points: the settled ones
    before the last (at least the last MIN_STEPS of them when a run is short). A step lasts until the next one
    starts, as the step loop tiles them (points measured before it did left the host work between two steps,
    the decode records' writes, in a gap between them, which this counts as the engine's time all the same)."""
    starts = np.asarray(sample["start"])
    start = starts[:-1]
    first = min(int(np.searchsorted(start, start[0] + SETTLE_S)), max(len(start) - MIN_STEPS, 1))
    kv_tokens, kv_max = (np.asarray(sample[k], int)[first:-1] for k in ("kv_tokens", "kv_max"))
    dur = np.diff(starts)[first:]
    if not dur.size:
        raise ValueError("a decode run needs at least 3 decode steps (budget 4)")
    return kv_tokens, kv_max, dur


def decode_points(run: Run, sample: dict, window: int) -> list[dict]:
    """One point per `window` consecutive usable steps: the middle step's K/V read, the steps' time statistics.

    A window of an even count drops its first step, so that the median step is one step, whose K/V read is
    the point's.
    """
    kv_tokens, kv_max, dur = usable_steps(sample)
    parts = [i[len(i) % 2 == 0:] for i in np.array_split(np.arange(dur.size), -(-dur.size // window))]
    points = []
    for i in parts:
        m = i[len(i) // 2]
        tokens, longest = int(kv_tokens[m]), int(kv_max[m])
        points.append({"rows": run.width, "kv_tokens": tokens, "kv_max": longest,
                       "kv_read": int(kv_read(run.backend, run.width, tokens, longest)), **stats(dur[i]),
                       "run": run.label})
    return points
