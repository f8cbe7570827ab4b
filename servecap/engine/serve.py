"""The real engine's side of the step loop: a timer that runs the model runner's steps and reads a clock.

It imports no torch: the model runner is passed in. With a real runner and the wall clock this is the engine;
with a runner that only advances a virtual clock it replays the loop exactly, which the tests use to hold the
simulator to the engine's behaviour.
"""
from __future__ import annotations

import time
from typing import Callable, Protocol

from servecap.costs.shapes import DecodeShape
from servecap.traces.workload import Trace

from servecap.core.config import ServingConfig
from servecap.core.recorder import Recorder
from servecap.core.scheduler import PrefillWork, Scheduler, Seq
from servecap.core.step_loop import StepLoop, TraceArrivals, drive


class Runner(Protocol):
    block_size: int
    num_blocks: int
    max_tokens: int

    def prefill(self, work: PrefillWork) -> list[int]: ...

    def decode(self, rows: list[Seq], backend: str) -> list[int]: ...


class WallClock:
    """Seconds since the run started; waits sleep, then spin the last stretch for sub-ms accuracy."""

    def __init__(self, t0: float | None = None):
        self.t0 = time.perf_counter() if t0 is None else t0  # perf_counter is one clock for every process here

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def wait_until(self, t: float) -> None:
        while (left := t - self.now()) > 0:
            if left > 2e-3:
                time.sleep(left - 1e-3)


class EngineTimer:
    """Steps take what the runner takes: one decode step at a time, timed by the clock."""

    fast_forward = False

    def __init__(self, runner: Runner, backend: str, clock):
        self.runner, self.backend, self.clock = runner, backend, clock

    def now(self) -> float:
        return self.clock.now()

    def wait_until(self, t: float) -> None:
        self.clock.wait_until(t)

    def prefill(self, work: PrefillWork, start: float) -> tuple[list[int], float]:
        tokens = self.runner.prefill(work)
        return tokens, self.clock.now()

    def decode(self, rows: list[Seq], shape: DecodeShape, start: float, limit: int,
               stop: float) -> tuple[list[int], list[float]]:
        tokens = self.runner.decode(rows, self.backend)
        return tokens, [self.clock.now()]

    def retired(self, n: int) -> None:
        pass  # writing the records took real time, which the clock already shows


def serve(trace: Trace | None, runner: Runner, recorder: Recorder, serving: ServingConfig,
          pool_blocks: int | None = None, clock=None, on_finish: Callable[[list[Seq]], None] | None = None,
          arrivals=None) -> Scheduler:
    """Replay `trace` (arrival times from the run's start) through the engine, or serve what `arrivals` hands
    over as it comes (a replica behind a router), with `serving`'s rows and policies; rows go to `recorder`."""
    clock = clock or WallClock()
    sched = serving.scheduler(pool_blocks or runner.num_blocks, runner.max_tokens)
    timer = EngineTimer(runner, recorder.backend, clock)
    drive(StepLoop(sched, recorder, timer, arrivals or TraceArrivals(trace.requests), on_finish), timer)
    return sched
