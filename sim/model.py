"""The simulator: engine/serve.py's step loop as a SimPy process, with step durations from a cost model.

The scheduler, block pool and recorder are the engine's own, so admission, grouping and retirement are the
engine's decisions; only how long a step takes is modelled. Each loop pass does what serve() does:
submit the arrivals due, admit a group and prefill it, decode one token for every running row, retire.

Fast-forward. Between two retirements the decode rows can only change through an admission. When none can
happen before the next retirement (every row is busy; or the queue head is waiting for blocks, which only a
retirement frees; or the next arrival will not fit in the free blocks), a whole stretch of decode steps is
computed at once with numpy and the clock jumps to its end in one SimPy timeout. When the next arrival would
be admitted, the stretch stops at the first step that ends at or after it, where serve() would admit it.
The arithmetic is the one-step arithmetic done in order (the times are a cumulative sum that starts from
the stretch's start), so a fast-forwarded run is identical, bit for bit, to one stepped one step at a time.

Arrivals are read from the trace by time at each step boundary, as serve() reads its pending list; the
engine never looks at them between boundaries, so they need no SimPy events of their own.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import simpy

from calibrate.cost_model import CostModel
from engine.block_pool import BlockPool
from engine.recorder import Recorder
from engine.scheduler import Scheduler, Seq
from traces.errors import InputError
from traces.records import RunRecord, RunWriter
from traces.workload import Request, Trace

from .inputs import check_backend, unbounded_pool

# What a run keeps: "summary" the requests and prefill steps (all the metrics need), "steps" every step,
# "tokens" every step and every token's time.
DETAILS = ("summary", "steps", "tokens")


@dataclass(frozen=True)
class SimConfig:
    backend: str = "paged"
    max_batch: int = 32
    pool_blocks: int | None = None  # None: enough that the pool never binds (see unbounded_pool)
    block_size: int = 64
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
    passes: int  # engine-loop passes, one SimPy timeout each; fewer than steps thanks to fast-forward
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


class _Engine:
    def __init__(self, env: simpy.Environment, trace: Trace, cost: CostModel, cfg: SimConfig, pool_blocks: int,
                 recorder: Recorder, on_finish: Callable[[int], None] | None):
        self.env, self.cost, self.cfg, self.rec, self.on_finish = env, cost, cfg, recorder, on_finish
        self.sched = Scheduler(cfg.max_batch, BlockPool(pool_blocks, cfg.block_size), cost.table["max_tokens"])
        self.pending: list[Request] = sorted(trace.requests, key=lambda r: r.arrival)
        self.now = 0.0  # the exact clock; env.now follows it to within rounding (see _until)
        self.prefills = self.decodes = self.passes = 0
        self.noise = None
        if cfg.noise_seed is not None:
            self.noise = (_Noise(cfg.noise_seed, 0, cost.prefill_sigma),
                          _Noise(cfg.noise_seed, 1, cost.decode_sigma[cfg.backend]))

    def _until(self, t: float) -> simpy.Timeout:
        # SimPy adds the delay to its own clock, which may round t differently; keeping t here keeps the
        # record's times exactly what serve() computes.
        self.now = t
        return self.env.timeout(max(0.0, t - self.env.now))

    def _submit(self, req: Request) -> None:
        try:
            self.sched.submit(req)
        except InputError as e:  # refused and recorded, as serve() does; the run goes on
            self.rec.reject(req, str(e))

    def _prefill(self, group: list[Seq], start: float) -> float:
        d = self.cost.prefill(len(group), max(s.req.prompt_tokens for s in group))
        if self.noise:
            d *= float(self.noise[0].factors(self.prefills, 1)[0])
        self.prefills += 1
        return start + d

    def _admission_time(self, i: int) -> float:
        """The earliest time an admission can happen before the running rows retire: the arrival of the next
        request the scheduler will accept, if it fits in the free blocks and a row is free; else never."""
        sched = self.sched
        if sched.queue or len(sched.running) >= sched.max_batch:  # a head waiting for blocks, or no free row
            return math.inf
        while i < len(self.pending):
            req = self.pending[i]
            try:
                sched.check(req)
            except InputError:  # it will be refused on arrival and change nothing
                i += 1
                continue
            fits = sched.pool.blocks_for(req.prompt_tokens + req.budget) <= sched.pool.free
            return req.arrival if fits else math.inf  # one that does not fit blocks everything behind it
        return math.inf

    def _decode(self, rows: list[Seq], start: float, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The stretch of decode steps from `start`: K/V tokens, widest row and end time of each step."""
        sched, n = self.sched, len(rows)
        k = max(1, min(s.remaining for s in sched.running)) if self.cfg.fast_forward else 1
        j = np.arange(k)
        kv_tokens = sched.kv_tokens + n + n * j  # each row also reads the token it writes this step
        kv_max = max(s.kv_len for s in rows) + 1 + j
        d = self.cost.decode(self.cfg.backend, n, kv_tokens, kv_max)
        if self.noise:
            d = d * self.noise[1].factors(self.decodes, k)
        ends = np.cumsum(np.concatenate(([start], d)))[1:]  # start + d0 + d1 + ... in order, as one step at a time
        stop = self._admission_time(i)
        if stop <= ends[-1]:
            k = int(np.searchsorted(ends, stop, side="left")) + 1
            kv_tokens, kv_max, ends = kv_tokens[:k], kv_max[:k], ends[:k]
        self.decodes += k
        return kv_tokens, kv_max, ends

    def run(self):
        sched, rec, cfg = self.sched, self.rec, self.cfg
        arrivals = [r.arrival for r in self.pending]
        steps_kept, tokens_kept = cfg.detail != "summary", cfg.detail == "tokens"
        retire_s = self.cost.retire_s
        i, step = 0, 0
        while True:
            t = self.now
            while i < len(arrivals) and arrivals[i] <= t:
                self._submit(self.pending[i])
                i += 1
            if sched.idle:
                if i == len(arrivals):
                    return
                yield self._until(arrivals[i])
                continue
            self.passes += 1
            start = t
            group = sched.admit(t, step)
            if group:
                t = self._prefill(group, start)
                sched.prefilled(group, t)
                if tokens_kept:
                    for s in group:
                        s.token_times.append(t)
                rec.prefill(step, group, start, t)
            rows = sched.decode_rows()
            k = 0
            if rows:
                kv_tokens, kv_max, ends = self._decode(rows, t, i)
                k = len(ends)
                ends_list = ends.tolist()
                decode_start, t = t, ends_list[-1]
                sched.advance(rows, t, k)
                if tokens_kept:
                    for s in rows:
                        s.token_times.extend(ends_list)
            done = sched.retire()
            end = t + retire_s * len(done)  # writing each finished row's records costs the engine this
            rec.finish(done)
            if rows and steps_kept:
                rec.decode_steps(step, len(rows), kv_tokens, kv_max, [decode_start] + ends_list[:-1],
                                 ends_list[:-1] + [end], len(done))
            if done and self.on_finish:
                self.on_finish(len(done))
            step += max(k, 1)
            yield self._until(end)


def simulate(trace: Trace, cost: CostModel, cfg: SimConfig = SimConfig(),
             on_finish: Callable[[int], None] | None = None) -> SimResult:
    """Run `trace` through the engine's scheduler on simulated time; the record has the engine's schema.

    Requests the scheduler refuses are recorded as rejected and the run goes on (as on the engine); check a
    trace up front with sim.inputs.validate to refuse it instead. `on_finish(n)` is called as rows retire.
    """
    check_backend(cost.table, cfg.backend)
    if not trace.requests:
        raise InputError("the trace has no requests")
    t0 = time.perf_counter()
    pool_blocks = cfg.pool_blocks or unbounded_pool(trace, cfg.max_batch, cfg.block_size)
    table = cost.table
    # The engine's run metadata, with the cost table standing in for the device it was measured on.
    run_meta = {"kind": "sim", "backend": cfg.backend, "trace_id": trace.trace_id, "trace": trace.meta,
                "max_batch": cfg.max_batch, "pool_blocks": pool_blocks, "block_size": cfg.block_size,
                "max_tokens": table["max_tokens"], "model": table["model"], "device": table["device"],
                "table_id": table["table_id"],
                "sim": {"detail": cfg.detail, "fast_forward": cfg.fast_forward, "noise_seed": cfg.noise_seed,
                        "strict": cost.strict}}
    tables = ("requests", "steps", "rejected") + (("tokens",) if cfg.detail == "tokens" else ())
    writer = RunWriter(None, run_meta, tables)
    env = simpy.Environment()
    engine = _Engine(env, trace, cost, cfg, pool_blocks, Recorder(writer, cfg.backend, cfg.detail == "tokens"),
                     on_finish)
    env.process(engine.run())
    env.run()
    steps = engine.prefills + engine.decodes
    writer.close(sim_steps=steps, sim_passes=engine.passes)
    return SimResult(writer.record(), pool_blocks, steps, engine.passes, time.perf_counter() - t0)
