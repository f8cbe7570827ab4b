"""The plan's points for the mechanisms deployed engines have and the write-up's engine lacked, each beside the
policy it replaces, on the same traces: on-demand KV admission with preemption (beside reserve-on-admit), fused
mixed steps (beside padded and chunked prefill), and prefix caching (on beside off).

Every point's rate comes from the simulator's own capacity search of the frozen table (servecap/validate/plan.py's
`capacity`), so the points sit where the policies differ: where memory binds and where it does not, near and past
capacity. Repeats are planned near capacity, where one real run is noisy: `repeats` (near, past) runs, on freshly
started engines where `fresh` (the plan's --repeats).
"""
from __future__ import annotations

from typing import Callable

from servecap.core.block_pool import PoolSize
from servecap.core.config import ServingConfig
from servecap.sim.sweep import Workload
from servecap.traces.workload import Trace

from .points import Point, round_rate as _round

MECHANISMS = ("on-demand", "mixed", "prefix-cache")
FUSED = ("mixed:512", "mixed:2048")


class Repeats:
    """Runs per point near and past capacity, and whether each runs on a freshly started engine."""

    def __init__(self, near: int = 2, past: int = 1, fresh: bool = False):
        self.near, self.past, self.fresh = near, past, fresh

    def loads(self) -> tuple[tuple[float, str, int], ...]:
        """(rate over capacity, load, repeats) of the near and the past point."""
        return (1.0, "near", self.near), (1.5, "past", self.past)


def on_demand_points(capacity: Callable, poisson: Callable[[float], dict], seeded: Workload, window: Trace | None,
                     scaled: Callable, repeats: Repeats = Repeats()) -> list[Point]:
    """Both admission policies: the seeded workload with a 0.5 GiB pool past and near on-demand's capacity (memory
    binds), with a pool that never binds near capacity (the two must agree), and the Azure window on 16 rows with
    1 GiB past capacity (the pool binds there too)."""
    small = ServingConfig(pool=PoolSize(gib=0.5))
    points = []
    cap_od = capacity(small.but(admission="on-demand"), seeded)
    cap_large = capacity(ServingConfig(pool=PoolSize(gib=64.0)), seeded)
    for admission in ("reserve", "on-demand"):
        tag = "od" if admission == "on-demand" else "rs"
        for f, role, k in repeats.loads():
            rate = _round(f * cap_od)
            points.append(Point(f"{tag}-small-pool-{role}-rate-{rate:g}", "on-demand", poisson(rate),
                                small.but(admission=admission), repeats=k, fresh=repeats.fresh))
        rate = _round(cap_large)
        points.append(Point(f"{tag}-large-pool-near-rate-{rate:g}", "on-demand", poisson(rate),
                            ServingConfig(admission=admission), repeats=repeats.past, fresh=repeats.fresh))
    if window is not None:
        azure = ServingConfig(max_batch=16, pool=PoolSize(gib=1.0))
        wcap = capacity(azure.but(admission="on-demand"), Workload(base=window))
        for admission in ("reserve", "on-demand"):
            tag = "od" if admission == "on-demand" else "rs"
            points.append(scaled(window, 1.5 * wcap, f"{tag}-azure-16rows-1gib-past", "on-demand",
                                 azure.but(admission=admission), repeats.past, repeats.fresh))
    return points


def mixed_points(capacity: Callable, poisson: Callable[[float], dict], seeded: Workload, window: Trace | None,
                 lengths: Trace | None, scaled: Callable, seed: int, repeats: Repeats = Repeats()) -> list[Point]:
    """Fused steps: the closed mixed control on 32 rows (wall time, first token, the largest gap between an
    incumbent's tokens), the seeded workload near and past mixed:512's capacity, the Azure window near and past
    for both budgets, and the ShareGPT lengths past capacity."""
    points = [Point(f"{p.replace(':', '')}-closed-mixed-32", "mixed", {"kind": "closed-mixed", "n": 32, "seed": seed},
                    ServingConfig(prefill=p), warmup=1, repeats=2, tokens=True) for p in FUSED]
    large = ServingConfig(pool=PoolSize(gib=64.0), prefill=FUSED[0])
    cap = capacity(large, seeded)
    for f, role, k in repeats.loads():
        rate = _round(f * cap)
        points.append(Point(f"mixed512-{role}-rate-{rate:g}", "mixed", poisson(rate), ServingConfig(prefill=FUSED[0]),
                            repeats=k, fresh=repeats.fresh))
    for policy in FUSED:
        tag = policy.replace(":", "")
        if window is not None:
            wcap = capacity(large.but(prefill=policy), Workload(base=window))
            for f, role, k in repeats.loads():
                points.append(scaled(window, f * wcap, f"{tag}-azure-conv-{role}", "mixed",
                                     ServingConfig(prefill=policy), k, repeats.fresh))
        if lengths is not None and policy == FUSED[0]:
            scap = capacity(large.but(prefill=policy), Workload(base=lengths))
            points.append(scaled(lengths, 1.3 * scap, f"{tag}-sharegpt-past", "mixed", ServingConfig(prefill=policy),
                                 repeats.past, repeats.fresh))
    return points


def prefix_cache_points(capacity: Callable, traces: dict[str, Trace], scaled: Callable,
                        repeats: Repeats = Repeats()) -> list[Point]:
    """The cache on and off on each trace with shared prefixes, near the cache-off capacity (repeated) and past
    it, where what caching buys shows as served rate."""
    points = []
    for name, base in traces.items():
        cap = capacity(ServingConfig(pool=PoolSize(gib=64.0)), Workload(base=base))
        for cache in (False, True):
            tag = "cache-on" if cache else "cache-off"
            for f, role, k in repeats.loads():
                points.append(scaled(base, f * cap, f"{tag}-{name}-{role}", "prefix-cache",
                                     ServingConfig(prefix_cache=cache), k, repeats.fresh))
    return points
