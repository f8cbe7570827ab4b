"""The parallel sweep: every configuration (backend x prefill policy x max batch x pool x replicas x router) at
every arrival rate.

Each point is simulated and scored in a worker process, which sends back one summary row; the cost model
and the base trace are set up once per worker. With automatic rates each configuration first gets a
capacity estimate from one saturated run (all requests queued at t=0: the rate the engine serves when it
never waits for work), and its rates then span 0.3x to 2x that estimate.

The points run on local worker processes, or elsewhere through `remote` (sim/remote.py: Modal containers), which
sends the same worker setup and calls the same functions, so the rows are the same either way.
"""
from __future__ import annotations

import os
import warnings
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np
from tqdm import tqdm

from costs.model import CostModel
from costs.table import CostTable
from engine.block_pool import blocks_for_gib
from engine.scheduler import PrefillPolicy
from traces.metrics import capacity_bracket, served_rate, summary
from traces.slo import SLO
from traces.workload import Trace, poisson_trace

from .fleet import simulate_fleet
from .inputs import at_rate, closed
from .simulator import SimConfig, simulate

AUTO_SPAN = (0.3, 2.0)
AUTO_POINTS = 12


@dataclass(frozen=True)
class Config:
    backend: str
    max_batch: int
    pool_gib: float
    prefill: str = "padded"  # a PrefillPolicy as text: padded, packed, chunked:N
    replicas: int = 1  # engines of this configuration behind a router (sim/fleet.py)
    router: str = "round-robin"

    @property
    def label(self) -> str:
        policy = "" if self.prefill == "padded" else f", {self.prefill} prefill"
        fleet = "" if (self.replicas, self.router) == (1, "round-robin") else \
            f", {self.replicas} replica{'s' * (self.replicas > 1)} behind {self.router}"
        return f"{self.backend}{policy}, max batch {self.max_batch}, pool {self.pool_gib:g} GiB{fleet}"

    def pool_blocks(self, block_size: int) -> int:
        return blocks_for_gib(self.pool_gib, block_size)


@dataclass(frozen=True)
class Workload:
    """The requests every point replays: a trace file scaled to each rate, or the seeded Poisson trace (n, seed)."""

    n: int = 400
    seed: int = 0
    base: Trace | None = None

    def at(self, rate: float) -> Trace:
        return at_rate(self.base, rate) if self.base is not None else poisson_trace(rate, self.n, self.seed)

    def saturated(self) -> Trace:
        return closed(self.base if self.base is not None else poisson_trace(1.0, self.n, self.seed))


@dataclass
class ConfigResult:
    config: Config
    pool_blocks: int
    rates: list[float]
    estimate: float | None  # req/s from the saturated run, when the rates were chosen automatically
    rows: list[dict] = field(default_factory=list)

    @property
    def bracket(self) -> tuple[float | None, float | None]:
        return capacity_bracket((r["rate"], r["stable"]) for r in self.rows)

    @property
    def slo_bracket(self) -> tuple[float | None, float | None]:
        """The capacity bracket by the SLOs (traces/metrics.py: slo_ok), for a sweep given SLOs."""
        return capacity_bracket((r["rate"], r["slo_ok"]) for r in self.rows)


# Set once per worker process by _init.
_cost: CostModel | None = None
_workload: Workload | None = None
_noise_seed: int | None = None
_slos: tuple[SLO, ...] = ()


def _init(table: CostTable, strict: bool, workload: Workload, noise_seed: int | None,
          slos: tuple[SLO, ...] = ()) -> None:
    global _cost, _workload, _noise_seed, _slos
    _cost, _workload, _noise_seed, _slos = CostModel(table, strict), workload, noise_seed, slos


def _simulate(config: Config, trace: Trace):
    cfg = SimConfig(config.backend, config.max_batch, config.pool_blocks(_cost.table.block_size),
                    noise_seed=_noise_seed, policy=PrefillPolicy.parse(config.prefill))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = simulate(trace, _cost, cfg) if config.replicas == 1 else \
            simulate_fleet(trace, _cost, cfg, config.replicas, config.router)
    return result, [str(w.message) for w in caught]


def _estimate(config: Config) -> tuple[float, list[str]]:
    result, caught = _simulate(config, _workload.saturated())
    return served_rate(result.record), caught


def _point(config: Config, rate: float) -> tuple[dict, list[str]]:
    result, caught = _simulate(config, _workload.at(rate))
    row = {**asdict(config), "rate": rate, "pool_blocks": result.pool_blocks,
           "trace_id": result.record.meta["trace_id"], **summary(result.record, rate, _slos),
           "sim_events": result.events, "sim_wall_s": result.wall_s}
    return row, caught


def auto_rates(estimate: float) -> list[float]:
    """AUTO_POINTS rates from 0.3x to 2x the estimate, evenly spaced in ratio, to 3 significant figures."""
    return [float(f"{r:.3g}") for r in np.geomspace(AUTO_SPAN[0] * estimate, AUTO_SPAN[1] * estimate, AUTO_POINTS)]


def _run_all(pool, fn, args: list[tuple], desc: str, progress: bool) -> list:
    """fn(*a) for every a, in parallel when a process pool is given; results in the order of args."""
    if pool is None:
        return [fn(*a) for a in tqdm(args, desc=desc, unit="pt", disable=not progress)]
    futures = [pool.submit(fn, *a) for a in args]
    for f in tqdm(as_completed(futures), total=len(futures), desc=desc, unit="pt", disable=not progress):
        f.result()  # the first failure (say, a strict-mode extrapolation) stops the sweep
    return [f.result() for f in futures]


# (the workers' setup: _init's arguments, fn, [args of each call], progress label, show progress) -> the results
# in the order of the calls. sim/remote.py makes one that runs the calls in Modal containers.
RemoteMap = Callable[[tuple, Callable, list[tuple], str, bool], list]


def run_sweep(table: CostTable, configs: list[Config], rates: list[float] | None, workload: Workload, *,
              strict: bool = False, noise_seed: int | None = None, jobs: int | None = None,
              progress: bool = True, slos: tuple[SLO, ...] = (),
              remote: RemoteMap | None = None) -> tuple[list[ConfigResult], list[str]]:
    """Every configuration at every rate (rates=None: automatic per configuration), scored against `slos` if
    any, on local processes or through `remote`; the results per configuration and the distinct cost-model
    warnings raised on the way."""
    jobs = jobs or os.cpu_count() or 1
    init = (table, strict, workload, noise_seed, slos)
    seen: dict[str, None] = {}
    pool = ProcessPoolExecutor(jobs, initializer=_init, initargs=init) if jobs > 1 and remote is None else None
    if pool is None and remote is None:
        _init(*init)

    def run_all(fn: Callable, args: list[tuple], desc: str) -> list:
        if remote is not None:
            return remote(init, fn, args, desc, progress)
        return _run_all(pool, fn, args, desc, progress)

    try:
        estimates: list[float | None] = [None] * len(configs)
        if rates is None:
            found = run_all(_estimate, [(c,) for c in configs], "capacity estimates")
            estimates = [e for e, _ in found]
            seen.update((w, None) for _, caught in found for w in caught)
        results = [ConfigResult(c, c.pool_blocks(table.block_size), rates or auto_rates(e), e)
                   for c, e in zip(configs, estimates)]
        owners = [res for res in results for _ in res.rates]
        points = run_all(_point, [(res.config, rate) for res in results for rate in res.rates], "sweep")
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    for res, (row, caught) in zip(owners, points):
        res.rows.append(row)
        seen.update((w, None) for w in caught)
    return results, list(seen)
