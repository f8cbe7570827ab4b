"""The parallel sweep: every configuration (backend x prefill policy x max batch x pool x replicas x router) at
every arrival rate, on every workload seed.

Each point is simulated and scored (against the sweep's SLOs, if any) by a worker, which sends back one summary
row; the cost model, the workload and the SLOs are set up once per worker. The workers are local processes, tied
to the sweep's process so that they end with it however it ends, or run elsewhere through `remote` (servecap/sim/remote.py:
Modal containers), which ships the same setup and calls the same functions, so a point's row is the same either way.

Wherever a point ran, its result is kept in a PointStore as it comes back (a points file under the sweep's output,
for the CLI), under its configuration (replicas and router included), seed and rate, so an interrupted sweep, local
or remote, resumes where it stopped and runs only the points it lacks. With automatic rates each configuration
first gets a capacity estimate from one saturated run (all requests queued at t=0: the rate the engine serves when
it never waits for work), and its rates then span 0.3x to 2x that estimate.
"""
from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

import numpy as np
from tqdm import tqdm

from servecap.costs.model import CostModel
from servecap.costs.table import CostTable
from servecap.core.block_pool import largest_request_tokens
from servecap.core.config import ServingConfig
from servecap.traces.latency import DEFAULT_PERCENTILES
from servecap.traces.slo import SLO
from servecap.traces.workload import Trace, at_rate, poisson_trace

from .inputs import closed
from .store import PointStore
from .workers import recording_warnings, stop, tie_to_parent

# traces.metrics, .simulator and .fleet (pandas, SimPy) are imported where points are simulated and scored: the CLI
# imports this module for its defaults, and `--help` should not wait for them.

AUTO_SPAN = (0.3, 2.0)
AUTO_POINTS = 12


@dataclass(frozen=True)
class Workload:
    """The requests every point replays: a trace file scaled to each rate, or the seeded trace (n, seed; Poisson
    unless bursty or ramped)."""

    n: int = 400
    seed: int = 0
    base: Trace | None = None
    burstiness: float = 1.0  # the seeded trace's arrivals (servecap/traces/workload.py: poisson_arrivals)
    ramp_up_s: float = 0.0

    def at(self, rate: float) -> Trace:
        return at_rate(self.base, rate) if self.base is not None else \
            poisson_trace(rate, self.n, self.seed, self.burstiness, self.ramp_up_s)

    def saturated(self) -> Trace:
        return closed(self.base if self.base is not None else poisson_trace(1.0, self.n, self.seed))


@dataclass
class ConfigResult:
    config: ServingConfig
    pool_blocks: int
    rates: list[float]
    estimate: float | None  # req/s from the saturated run, when the rates were chosen automatically
    rows: list[dict] = field(default_factory=list)
    seed: int | None = None  # the workload seed of these points (None: the workload's own)
    bands: list[dict] = field(default_factory=list)  # each rate's metrics' bands, with --interval (the first seed's)

    @property
    def bracket(self) -> tuple[float | None, float | None]:
        from servecap.traces.metrics import capacity_bracket
        return capacity_bracket((r["rate"], r["stable"]) for r in self.rows)

    @property
    def slo_bracket(self) -> tuple[float | None, float | None]:
        """The capacity bracket by the SLOs (servecap/traces/metrics.py: slo_ok), for a sweep given SLOs."""
        from servecap.traces.metrics import capacity_bracket
        return capacity_bracket((r["rate"], r["slo_ok"]) for r in self.rows)


# Set once per worker process by _init.
_cost: CostModel | None = None
_workload: Workload | None = None
_noise_seed: int | None = None
_slos: tuple[SLO, ...] = ()
_percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
_intervals: dict[float, object] = {}  # servecap.sim.intervals.Intervals by level, made at a worker's first band


def _init(table: CostTable | dict, strict: bool, workload: Workload, noise_seed: int | None, slos: tuple[SLO, ...] = (),
          percentiles: tuple[float, ...] = DEFAULT_PERCENTILES, parent: int | None = None) -> None:
    global _cost, _workload, _noise_seed, _slos, _percentiles
    if parent is not None:
        tie_to_parent(parent)
    _cost, _workload, _noise_seed, _slos = CostModel(table, strict), workload, noise_seed, slos
    _percentiles = percentiles
    _intervals.clear()


def _simulate(config: ServingConfig, trace: Trace):
    from .fleet import simulate_fleet
    from .simulator import SimConfig, simulate
    cfg = SimConfig(config, noise_seed=_noise_seed)
    return recording_warnings(simulate if config.replicas == 1 else simulate_fleet, trace, _cost, cfg)


def _workload_for(seed: int) -> Workload:
    return replace(_workload, seed=seed)


def _estimate(config: ServingConfig, seed: int) -> tuple[float, list[str]]:
    from servecap.traces.metrics import served_rate
    result, caught = _simulate(config, _workload_for(seed).saturated())
    return served_rate(result.record), caught


def _point(config: ServingConfig, rate: float, seed: int) -> tuple[dict, list[str]]:
    from servecap.traces.latency import latency_ms
    from servecap.traces.metrics import summary
    result, caught = _simulate(config, _workload_for(seed).at(rate))
    row = {**config.axes(), "rate": rate, "seed": seed, "pool_blocks": result.pool_blocks,
           "trace_id": result.record.meta["trace_id"], **summary(result.record, rate, _slos),
           **latency_ms(result.record, _percentiles), "sim_events": result.events, "sim_wall_s": result.wall_s}
    return row, caught


def _band(config: ServingConfig, rate: float, seeds: list[int], level: float) -> tuple[dict, list[str]]:
    """A point's LEVEL% bands (servecap/sim/intervals.py): its trace samples (the workload at these seeds, or a trace
    file's one) x the cost draws."""
    from .intervals import Intervals, simulated
    from .simulator import SimConfig
    if level not in _intervals:
        _intervals[level] = Intervals(_cost.table, level)
    traces = [_workload.at(rate)] if _workload.base is not None else [_workload_for(s).at(rate) for s in seeds]
    return recording_warnings(_intervals[level].band, traces, simulated(SimConfig(config), rate))


def auto_rates(estimate: float) -> list[float]:
    """AUTO_POINTS rates from 0.3x to 2x the estimate, evenly spaced in ratio, to 3 significant figures."""
    return [float(f"{r:.3g}") for r in np.geomspace(AUTO_SPAN[0] * estimate, AUTO_SPAN[1] * estimate, AUTO_POINTS)]


# (the workers' setup: _init's arguments, fn, [args of each call]) -> (index into the calls, fn(*args)) for every
# call, as each finishes, in any order. servecap/sim/remote.py makes one that runs the calls in Modal containers.
RemoteMap = Callable[[tuple, Callable, list[tuple]], Iterator[tuple[int, object]]]


def _run_all(pool: ProcessPoolExecutor | None, remote: RemoteMap | None, init: tuple, fn, args: list[tuple],
             keys: list[tuple], store: PointStore, desc: str, progress: bool) -> list:
    """fn(*a) for every a whose key the store lacks: through `remote` when given, else in parallel when a process
    pool is given, else here; each result added to the store as it comes back. Every result (as the store keeps
    it) in the order of args."""
    todo = [i for i, k in enumerate(keys) if k not in store]
    bar = tqdm(total=len(args), initial=len(args) - len(todo), desc=desc, unit="pt", disable=not progress)
    with bar:
        if remote is not None:
            if todo:  # nothing to send when a resumed sweep has every result
                for j, result in remote(init, fn, [args[i] for i in todo]):
                    store.add(keys[todo[j]], result)
                    bar.update()
        elif pool is None:
            for i in todo:
                store.add(keys[i], fn(*args[i]))
                bar.update()
        else:
            futures = {pool.submit(fn, *args[i]): i for i in todo}
            for f in as_completed(futures):
                store.add(keys[futures[f]], f.result())  # the first failure (a strict-mode extrapolation) stops all
                bar.update()
    return [store.get(k) for k in keys]


def run_sweep(table: CostTable, configs: list[ServingConfig], rates: list[float] | None, workload: Workload, *,
              seeds: list[int] | None = None, strict: bool = False, noise_seed: int | None = None,
              jobs: int | None = None, progress: bool = True, slos: tuple[SLO, ...] = (),
              remote: RemoteMap | None = None, store: PointStore | None = None,
              percentiles: tuple[float, ...] = DEFAULT_PERCENTILES,
              interval: float | None = None) -> tuple[list[ConfigResult], list[str]]:
    """Every configuration at every rate (rates=None: automatic per configuration) for every workload seed (default:
    the workload's own), scored against `slos` if any, on local processes or through `remote`; the results per
    configuration and seed, configuration-major, and the distinct cost-model warnings raised on the way. With
    automatic rates, every seed of a configuration runs the rates from the first seed's saturated estimate, so
    that the seeds can be compared rate by rate.

    A store keeps each result as it comes back, wherever it ran (and has those of an interrupted sweep): only
    missing points run.

    With `interval` (a level, %), each configuration's first seed's points also get their bands (ConfigResult.bands),
    on the same workers: their trace samples are the sweep's seeds, or with a single seed intervals.SEEDS seeds from it.
    """
    seeds = list(seeds) if seeds else [workload.seed]
    configs = list(dict.fromkeys(configs))  # a single engine named under several routers is one configuration
    store = store if store is not None else PointStore(None, {})
    jobs = jobs or os.cpu_count() or 1
    # What the workers run, imported before they are forked so that they share it rather than each importing
    # pandas and SimPy again (the CLI imports them lazily).
    from servecap.traces import metrics  # noqa: F401
    from . import fleet, simulator  # noqa: F401
    init = (table, strict, workload, noise_seed, slos, percentiles)
    seen: dict[str, None] = {}
    pool = ProcessPoolExecutor(jobs, initializer=_init, initargs=(*init, os.getpid())) \
        if jobs > 1 and remote is None else None
    if pool is None and remote is None:
        _init(*init)
    try:
        estimates: list[float | None] = [None] * len(configs)
        if rates is None:
            found = _run_all(pool, remote, init, _estimate, [(c, seeds[0]) for c in configs],
                             [("estimate", c.axes(), seeds[0]) for c in configs], store, "capacity estimates",
                             progress)
            estimates = [e for e, _ in found]
            seen.update((w, None) for _, caught in found for w in caught)
        largest = largest_request_tokens(workload.saturated().requests)  # sizes an unbounded pool only
        results = [ConfigResult(c, c.pool_blocks(largest), rates or auto_rates(e), e, seed=s)
                   for c, e in zip(configs, estimates) for s in seeds]
        args = [(res.config, rate, res.seed) for res in results for rate in res.rates]
        owners = [res for res in results for _ in res.rates]
        points = _run_all(pool, remote, init, _point, args, [("point", c.axes(), s, r) for c, r, s in args], store,
                          "sweep", progress)
        banded = [res for res in results if res.seed == seeds[0]] if interval is not None else []
        if banded:
            from .intervals import SEEDS
            samples = seeds if len(seeds) > 1 else list(range(seeds[0], seeds[0] + SEEDS))
            bargs = [(res.config, rate, samples, interval) for res in banded for rate in res.rates]
            bands = _run_all(pool, remote, init, _band, bargs,
                             [("band", c.axes(), r, level, tuple(ss)) for c, r, ss, level in bargs], store,
                             f"{interval:g}% intervals", progress)
            for (res, (band, caught)) in zip([res for res in banded for _ in res.rates], bands):
                res.bands.append(band)
                seen.update((w, None) for w in caught)
    except BaseException:
        if pool is not None:
            stop(pool)
        raise
    if pool is not None:
        pool.shutdown()
    for res, (row, caught) in zip(owners, points):
        res.rows.append(row)
        seen.update((w, None) for w in caught)
    return results, list(seen)
