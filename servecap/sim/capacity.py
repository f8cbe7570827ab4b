"""Capacity by search instead of a grid: the highest arrival rate a configuration holds, and the fewest replicas
that hold a rate (or each window of a varying trace).

A point "holds" as a sweep's point does (servecap/traces/metrics.py): it meets its SLOs (slo_ok) when SLOs are given, else
it is stable. Every probe is a sweep point, run by the sweep's own point runner (servecap/sim/sweep.py: _point, on the same
worker setup), so a probe's verdict is the one `sim sweep` gives at that rate.

Max rate, per workload seed: start from the saturated estimate (servecap/sim/sweep.py: _estimate), double (or halve) until
one rate holds and another fails, then bisect between the highest rate that held (lo) and the lowest that failed
above it (hi) until hi - lo <= rel_tol x hi. The answer is lo: it held, and a rate at most rel_tol higher failed.
A seeded trace is one sample of the workload, so the search runs on every seed and the answer is their band
(min, median, max).

Fewest replicas, per seed: double the replica count from 1 until it holds, then bisect between the largest count
that failed and the smallest that held. Per window of a trace (--window-s): the trace is cut into windows of its
arrival times, and each window's requests, run as they arrive (from the window's first arrival), are one point at
that window's offered rate (the trace's own rate over its requests: a point at exactly that rate replays them
unscaled). A window of one request has no rate and is not searched.

Both searches assume that holding is monotone (in rate, in replicas); near the boundary a sample can hold at one
rate and fail just below it, and bisection then finds one of the boundaries the sample has, inside the sweep's
bracket whenever the sweep's grid brackets it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from servecap.core.config import ServingConfig
from servecap.traces.slo import SLO
from servecap.traces.workload import ARRIVAL_DECIMALS, Request, Trace

from . import sweep

REL_TOL = 0.01
MAX_PROBES = 40  # a guard against a search that cannot close (a verdict that flips at every probe)
MAX_REPLICAS = 64


def holds(row: dict, slos: tuple[SLO, ...]) -> bool:
    return bool(row["slo_ok"] if slos else row["stable"])


@dataclass
class Search:
    """One search's answer and every probe it ran: (rate or replicas, held)."""

    seed: int
    answer: float | None  # the highest rate (fewest replicas) that held; None when none did
    bound: float | None  # the lowest rate that failed above it (the most replicas that failed below it)
    probes: list[tuple[float, bool]] = field(default_factory=list)
    estimate: float | None = None
    rows: list[dict] = field(default_factory=list)  # the probes' sweep rows


OnProbe = Callable[[int, float, bool], None]  # (seed, rate or replicas, held): each probe as it is decided


def max_rate(config: ServingConfig, seed: int, slos: tuple[SLO, ...], rel_tol: float = REL_TOL,
             max_probes: int = MAX_PROBES, on_probe: OnProbe | None = None) -> Search:
    """The highest rate `config` holds on the seed's trace (the sweep's worker setup must be in place: sweep._init)."""
    estimate, _ = sweep._estimate(config, seed)
    out = Search(seed, None, None, estimate=estimate)

    def probe(rate: float) -> bool:
        row, _ = sweep._point(config, rate, seed)
        out.rows.append(row)
        out.probes.append((rate, holds(row, slos)))
        if on_probe is not None:
            on_probe(seed, *out.probes[-1])
        return out.probes[-1][1]

    lo = hi = None
    rate = estimate
    while len(out.probes) < max_probes and (lo is None or hi is None):
        if probe(rate):
            lo = rate
            rate = rate * 2 if hi is None else (lo + hi) / 2
        else:
            hi = rate
            rate = rate / 2 if lo is None else (lo + hi) / 2
    while lo is not None and hi is not None and hi - lo > rel_tol * hi and len(out.probes) < max_probes:
        mid = (lo + hi) / 2
        if probe(mid):
            lo = mid
        else:
            hi = mid
    out.answer, out.bound = lo, hi
    return out


def fewest_replicas(config: ServingConfig, rate: float, seed: int, slos: tuple[SLO, ...],
                    max_replicas: int = MAX_REPLICAS, router: str | None = None,
                    on_probe: OnProbe | None = None) -> Search:
    """The fewest replicas of `config` that hold `rate` on the seed's trace, up to max_replicas (None: none of them),
    behind `router` (default config's: a single engine's configuration names none of its own)."""
    router = router or config.router
    out = Search(seed, None, None)
    verdicts: dict[int, bool] = {}

    def probe(k: int) -> bool:
        if k not in verdicts:
            row, _ = sweep._point(replace(config, replicas=k, router=router), rate, seed)
            out.rows.append(row)
            verdicts[k] = holds(row, slos)
            out.probes.append((k, verdicts[k]))
            if on_probe is not None:
                on_probe(seed, k, verdicts[k])
        return verdicts[k]

    failed, k = 0, 1
    while not probe(k):
        failed = k
        if k == max_replicas:
            out.bound = failed
            return out
        k = min(2 * k, max_replicas)
    held = k
    while held - failed > 1:
        mid = (failed + held) // 2
        if probe(mid):
            held = mid
        else:
            failed = mid
    out.answer, out.bound = held, failed or None
    return out


def windows(trace: Trace, window_s: float) -> list[tuple[float, Trace]]:
    """(window start, its requests as a trace from its first arrival) for every window [start, start + window_s)
    of the trace's arrivals that holds a request; the same requests, ids and lengths."""
    t0 = trace.requests[0].arrival
    out: dict[int, list[Request]] = {}
    for r in trace.requests:
        out.setdefault(int((r.arrival - t0) // window_s), []).append(r)
    parts = []
    for i, reqs in sorted(out.items()):
        first = reqs[0].arrival
        moved = [r.at(round(r.arrival - first, ARRIVAL_DECIMALS)) for r in reqs]
        parts.append((t0 + i * window_s, Trace(moved, {**trace.meta, "window_s": window_s,
                                                       "window_start": t0 + i * window_s})))
    return parts


def band(values: list[float | None]) -> dict:
    """min, median, max of the searches' answers that exist, and how many did not find one."""
    v = [x for x in values if x is not None and math.isfinite(x)]
    return {"min": min(v) if v else None, "median": float(np.median(v)) if v else None, "max": max(v) if v else None,
            "found": len(v), "seeds": len(values)}
