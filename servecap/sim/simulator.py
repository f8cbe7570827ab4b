"""The simulator: the engine's own step loop (servecap/core/step_loop.py) on a virtual clock, with step durations from
a cost model instead of a GPU.

The scheduler, block pool, recorder and loop are the engine's own, so admission, grouping, the prefill policy
and retirement are the engine's decisions; only how long a step takes is modelled, by SimTimer.

Fast-forward. Between two points where the scheduler has something to decide (a row finishing, a chunk step
due, an arrival that could be admitted), the decode rows cannot change, so SimTimer prices the whole stretch of
decode steps at once (CostModel.decode_stretch_in_context, in plain Python: a stretch is a few steps on average)
and the loop's clock jumps to its end in one pass. When the next arrival would be admitted, the stretch stops
at the first step that ends at or after it, where the engine would admit it. The arithmetic is the one-step
arithmetic done in order (the times are a cumulative sum that starts from the stretch's start), so a
fast-forwarded run is identical, bit for bit, to one stepped one step at a time.

One engine is one process with nothing to interleave, so simulate() drives its loop as the engine's driver does
(servecap/core/step_loop.drive), on SimTimer's clock: waiting is setting that clock. SimPy schedules the fleet
(servecap/sim/fleet.py), where replicas and the router take turns; for one engine it would only add an event per pass.
"""
from __future__ import annotations

import gc
import math
import time
import warnings
from bisect import bisect_left
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Callable

import numpy as np

from servecap.costs.context import RETIRED
from servecap.costs.model import CostModel
from servecap.costs.shapes import DecodeShape
from servecap.costs.table import check_compatible
from servecap.core.block_pool import largest_request_tokens
from servecap.core.config import ServingConfig
from servecap.core.recorder import Recorder
from servecap.core.policies import PrefillPolicy
from servecap.core.scheduler import PrefillWork, Seq
from servecap.core.step_loop import StepLoop, TraceArrivals, drive
from servecap.traces.errors import InputError
from servecap.traces.model_spec import config_hash
from servecap.traces.records import RunRecord, RunWriter
from servecap.traces.workload import Trace

# What a run keeps: "summary" the requests and prefill steps (all the metrics need), "steps" every step,
# "tokens" every step and every token's time.
DETAILS = ("summary", "steps", "tokens")


class DerivedCostWarning(UserWarning):
    pass


@dataclass(frozen=True)
class SimConfig:
    """What is served (the serving configuration, replicas and router included) and how the simulator runs it."""

    serving: ServingConfig = field(default_factory=ServingConfig)
    detail: str = "summary"
    fast_forward: bool = True
    noise_seed: int | None = None  # None: deterministic step times; else seeded log-normal noise

    def __post_init__(self):
        if self.detail not in DETAILS:
            raise ValueError(f"detail must be one of {DETAILS}, got {self.detail!r}")


@dataclass
class SimResult:
    record: RunRecord
    pool_blocks: int
    steps: int  # prefill and decode steps simulated
    passes: int  # engine-loop passes; fewer than steps thanks to fast-forward
    wall_s: float

    @property
    def events(self) -> int:
        """Requests plus steps: the work a run simulates, whatever its detail level or fast-forward."""
        return len(self.record.requests) + len(self.record.rejected) + self.steps


class _Noise:
    """Log-normal step-time factors by step number, drawn in fixed chunks, so a fast-forwarded stretch and
    single steps get the same factor for the same step."""

    CHUNK = 4096

    def __init__(self, seed: int, stream: int, sigma: float):
        if not (math.isfinite(sigma) and sigma >= 0):  # a NaN factor would stop the virtual clock for good
            raise InputError(f"the cost table's step-time sigma is {sigma}; seeded noise needs a finite one of 0 or "
                             "more")
        self._rng = np.random.default_rng([seed, stream])
        self._sigma = sigma
        self._buf = np.empty(0)
        self._base = 0  # step number of _buf[0]

    def factors(self, start: int, k: int) -> np.ndarray:
        while start + k > self._base + len(self._buf):
            keep = self._buf[max(0, start - self._base):]
            self._base += len(self._buf) - len(keep)
            self._buf = np.concatenate((keep, self._rng.lognormal(0.0, self._sigma, self.CHUNK)))
        return self._buf[start - self._base:start - self._base + k]


class SimTimer:
    """Step durations from the cost model on an exact clock of its own (SimPy's may round a sum differently)."""

    def __init__(self, cost: CostModel, backend: str, fast_forward: bool = True, noise_seed: int | None = None,
                 policy: str = "padded"):
        self.cost, self.backend, self.fast_forward, self.policy = cost, backend, fast_forward, policy
        self.t = 0.0
        self.prefills = self.decodes = 0
        # The serving context of the next step (servecap/costs/context.py): the last step's kind and when it ended.
        self.last_kind: str | None = None
        self.last_end = 0.0
        self.noise = None
        if noise_seed is not None:
            self.noise = (_Noise(noise_seed, 0, cost.prefill_sigma), _Noise(noise_seed, 1, cost.decode_sigma[backend]))

    def now(self) -> float:
        return self.t

    def wait_until(self, t: float) -> None:
        if t > self.t:
            self.t = t

    def prefill(self, work: PrefillWork, start: float, then: list[Seq]) -> tuple[None, float]:
        d = self.cost.prefill_in_context(work.shape, self.policy, self.last_kind, start - self.last_end)
        if self.noise:
            d *= float(self.noise[0].factors(self.prefills, 1)[0])
        self.prefills += 1
        self.t = start + d
        self.last_kind, self.last_end = work.kind, self.t  # a fused step is `mixed` to the next, as in records
        return None, self.t

    def decode(self, rows: list[Seq], shape: DecodeShape, start: float, limit: int, stop: float):
        k = limit  # the plan's bound: 1 unless this timer fast-forwards
        n, kv_tokens, kv_max = shape
        d = self.cost.decode_stretch_in_context(self.backend, n, kv_tokens, kv_max, k, self.policy, self.last_kind,
                                                start - self.last_end)
        if self.noise:
            d = [x * f for x, f in zip(d, self.noise[1].factors(self.decodes, k).tolist())]
        d[0] = start + d[0]
        ends = list(accumulate(d))  # start + d0 + d1 + ..., in order
        if stop <= ends[-1]:
            del ends[bisect_left(ends, stop) + 1:]  # through the first step that ends at or after stop
        self.decodes += len(ends)
        self.t = ends[-1]
        self.last_kind, self.last_end = "decode", self.t
        return None, ends

    def after_retiring(self, n: int) -> float:
        """When the next pass begins once n finished rows are retired: each costs the engine retire_s
        (calibration's)."""
        return self.t + self.cost.retire_s * n

    def retired(self, n: int) -> None:
        self.t = self.after_retiring(n)
        if self.last_kind == "decode":  # the next step starts a new pass after a stretch that retired rows
            self.last_kind = RETIRED

    def stretch_ended(self, steps: int) -> float:
        extra = self.cost.stretch_end_s(self.backend, self.policy, steps)
        self.t += extra
        return extra


def check_policy(cost: CostModel, policy: PrefillPolicy, strict: bool) -> None:
    """A table that never measured the policy's step shapes prices them with the derived model (servecap/costs/model.py):
    said once as a warning, or refused in strict mode."""
    if policy.name in cost.table.policies:
        return
    what = (f"cost table {cost.table.table_id} has no measured {policy.name} prefill steps; pricing them with the "
            f"model fitted to its {', '.join(cost.table.policies)} steps (same rows, positions and attention work)")
    if strict:
        raise InputError(what + " is refused in strict mode")
    warnings.warn(what, DerivedCostWarning, stacklevel=3)


@contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off for a run, as it was after. A run frees what it allocates by reference
    counting (it makes no reference cycles), so the collector finds nothing, yet every few hundred allocations it
    walks the young objects, and now and then every live one (the trace, the records): about a tenth of a run."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def start_run(trace: Trace, cost: CostModel, cfg: SimConfig, **fleet) -> tuple[int, RunWriter]:
    """What simulate() and a fleet (servecap/sim/fleet.py, which passes its shape as `fleet`) do before a run: refuse what
    cannot run, size the pool, and open the record with the engine's run metadata, the cost table standing in for
    the device it was measured on. Returns the pool's blocks and the record's writer."""
    table, serving = cost.table, cfg.serving
    check_compatible(table, config_hash(serving.spec), serving.block_size)
    if table.model["dtype"] != serving.dtype:
        raise InputError(f"cost table {table.table_id} was measured in {table.model['dtype']}, not {serving.dtype}")
    if serving.backend not in table.backends:
        raise InputError(f"{table.summary()} has no decode costs for backend {serving.backend!r} "
                         f"(it has {', '.join(table.backends)})")
    check_policy(cost, serving.prefill, cost.strict)
    if not trace.requests:
        raise InputError("the trace has no requests")
    pool_blocks = serving.pool_blocks(largest_request_tokens(trace.requests))
    run_meta = {"kind": "sim", "backend": serving.backend, "prefill": str(serving.prefill),
                "admission": str(serving.admission), "prefix_cache": serving.prefix_cache, "trace_id": trace.trace_id,
                "trace": trace.meta, "max_batch": serving.max_batch, "pool_blocks": pool_blocks,
                "block_size": table.block_size, "max_tokens": table.max_tokens, "model": table.model,
                "device": table.device, "table_id": table.table_id,
                "sim": {"detail": cfg.detail, "fast_forward": cfg.fast_forward, "noise_seed": cfg.noise_seed,
                        "strict": cost.strict}, **fleet}
    tables = ("requests", "steps", "rejected") + (("tokens",) if cfg.detail == "tokens" else ())
    return pool_blocks, RunWriter(None, run_meta, tables)


def simulate(trace: Trace, cost: CostModel, cfg: SimConfig = SimConfig(),
             on_finish: Callable[[int], None] | None = None) -> SimResult:
    """Run `trace` through the engine's scheduler and step loop on simulated time; the record has the engine's
    schema.

    Requests the scheduler refuses are recorded as rejected and the run goes on (as on the engine); check a
    trace up front with sim.inputs.check_trace to refuse it instead. `on_finish(n)` is called as rows retire.
    """
    t0 = time.perf_counter()
    pool_blocks, writer = start_run(trace, cost, cfg)
    serving = cfg.serving
    recorder = Recorder(writer, serving.backend, tokens=cfg.detail == "tokens", decode_steps=cfg.detail != "summary")
    sched = serving.scheduler(pool_blocks, serving.max_positions)
    timer = SimTimer(cost, serving.backend, cfg.fast_forward, cfg.noise_seed, str(serving.prefill))
    loop = StepLoop(sched, recorder, timer, TraceArrivals(trace.requests),
                    (lambda done: on_finish(len(done))) if on_finish else None)
    with _collector_paused():
        drive(loop, timer)
    steps = timer.prefills + timer.decodes
    writer.close(sim_steps=steps, sim_passes=loop.passes)
    return SimResult(writer.record(), pool_blocks, steps, loop.passes, time.perf_counter() - t0)

