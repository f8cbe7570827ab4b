"""A measured run's cost-table points: prefill repetitions and decode step windows, as median and spread.

A decode run's steps are used without the first SETTLE_S seconds after its prefill and without its last step
(where every row retires; that step measures the overhead instead). After a large prefill the H200 runs decode
steps up to 25% slower for some 50-100 ms before they settle (measured: a 32 x 4096 group's first decode step
3.65 ms, 2.84 ms at 60 ms, 2.79 ms from 120 ms on), while an engine serving arrivals spends nearly all its
steps settled; a table built from the transient predicted the validation runs' steps 5% slow.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from costs.shapes import kv_read

from .plan import Run

SETTLE_S = 0.1
MIN_STEPS = 3


def stats(durations) -> dict:
    d = np.asarray(durations, float)
    p10, med, p90 = np.percentile(d, [10, 50, 90])
    return {"median_s": float(med), "p10_s": float(p10), "p90_s": float(p90), "n": int(d.size)}


def prefill_steps(sample: dict) -> dict[tuple[int, int, int], list[float]]:
    """Every prefill step of a run's repetitions, by shape (rows, tokens, attn): its durations."""
    by_shape: dict[tuple[int, int, int], list[float]] = defaultdict(list)
    for rep in sample["prefill"]:
        for rows, tokens, attn, dur in rep:
            by_shape[rows, tokens, attn].append(dur)
    return by_shape


def prefill_points(run: Run, sample: dict) -> list[dict]:
    """One point per distinct step shape of the run (a chunked prompt's chunks are several)."""
    policy = run.policy.partition(":")[0]
    return [{"policy": policy, "rows": r, "tokens": t, "attn": a, **stats(d), "run": run.label}
            for (r, t, a), d in prefill_steps(sample).items()]


def first_over_again(run: Run, sample: dict) -> float:
    """A stationarity run's first-run time over the median of its repeats (prefill: the run's prefill steps
    summed; decode: the median step)."""
    if run.kind == "stationary-decode":
        return float(np.median(sample["first"]) / np.median(sample["again"]))
    totals = [sum(s[3] for s in rep) for rep in sample["prefill"]]
    return float(totals[0] / np.median(totals[1:]))


def usable_steps(sample: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """K/V tokens (all rows, longest row) and duration of the decode steps that make points: the settled ones
    before the last (at least the last MIN_STEPS of them when a run is short)."""
    start = np.asarray(sample["start"])[:-1]
    first = min(int(np.searchsorted(start, start[0] + SETTLE_S)), max(len(start) - MIN_STEPS, 1))
    kv_tokens, kv_max = (np.asarray(sample[k], int)[first:-1] for k in ("kv_tokens", "kv_max"))
    dur = (np.asarray(sample["end"])[:-1] - start)[first:]
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
