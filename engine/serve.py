"""The engine's step loop: admit, prefill the new group, decode one step for every running row, retire.

It imports no torch: the model runner is passed in. With a real runner and the wall clock this is the
engine; with a runner that only advances a virtual clock it replays the loop exactly, which the tests
use to hold the simulator to the engine's behaviour.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable, Protocol

from traces.errors import InputError
from traces.workload import Trace

from .block_pool import BlockPool
from .recorder import Recorder
from .scheduler import Scheduler, Seq


class Runner(Protocol):
    block_size: int
    num_blocks: int
    max_tokens: int

    def prefill(self, group: list[Seq]) -> list[int]: ...

    def decode(self, rows: list[Seq], backend: str) -> list[int]: ...


class WallClock:
    """Seconds since the run started; waits sleep, then spin the last stretch for sub-ms accuracy."""

    def __init__(self):
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def wait_until(self, t: float) -> None:
        while (left := t - self.now()) > 0:
            if left > 2e-3:
                time.sleep(left - 1e-3)


def serve(trace: Trace, runner: Runner, recorder: Recorder, max_batch: int, pool_blocks: int | None = None,
          clock=None, on_finish: Callable[[int], None] | None = None) -> Scheduler:
    """Replay `trace` (arrival times from the run's start) through the engine; rows go to `recorder`."""
    clock = clock or WallClock()
    pool = BlockPool(pool_blocks or runner.num_blocks, runner.block_size)
    sched = Scheduler(max_batch, pool, runner.max_tokens)
    pending = deque(sorted(trace.requests, key=lambda r: r.arrival))
    backend = recorder.backend
    step = 0
    open_row = None  # the last decode step's row: it ends where the next pass starts, so rows tile the run's time
    while True:
        t = clock.now()
        if open_row:
            recorder.decode(*open_row, end=t)
            open_row = None
        while pending and pending[0].arrival <= t:
            req = pending.popleft()
            try:
                sched.submit(req)
            except InputError as e:  # a bad request is refused and recorded; the run goes on
                recorder.reject(req, str(e))
        if sched.idle:
            if not pending:
                break
            clock.wait_until(pending[0].arrival)
            continue
        start = t
        group = sched.admit(t, step)
        if group:
            first = runner.prefill(group)
            t1 = clock.now()
            sched.prefilled(group, t1)
            for s, tok in zip(group, first):
                s.token_ids.append(tok)
                s.token_times.append(t1)
            recorder.prefill(step, group, start, t1)
            start = t1
        rows = sched.decode_rows()
        if rows:
            kv_tokens = sched.kv_tokens + len(rows)  # each row also reads the token it writes this step
            kv_max = max(s.kv_len for s in rows) + 1
            toks = runner.decode(rows, backend)
            t2 = clock.now()
            sched.advance(rows, t2)
            for s, tok in zip(rows, toks):
                s.token_ids.append(tok)
                s.token_times.append(t2)
        done = sched.retire()
        recorder.finish(done)
        if rows:
            open_row = (step, len(rows), kv_tokens, kv_max, start, len(done))
        if on_finish and done:
            on_finish(len(done))
        step += 1
    return sched
