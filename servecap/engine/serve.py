"""The real engine's side of the step loop: a timer that runs the model runner's steps and reads a clock.

It imports no torch: the model runner is passed in. With a real runner and the wall clock this is the engine;
with a runner that only advances a virtual clock it replays the loop exactly, which the tests use to hold the
simulator to the engine's behaviour.
"""
from __future__ import annotations

import math
import time
from itertools import islice
from typing import Callable, Iterable, Protocol

from servecap.costs.shapes import DecodeShape
from servecap.traces.workload import Trace

from servecap.core.config import ServingConfig
from servecap.core.recorder import Recorder, WriteBehind
from servecap.core.scheduler import PrefillWork, Scheduler, Seq
from servecap.core.step_loop import StepLoop, TraceArrivals, drive


class Runner(Protocol):
    """The model runner as the timer drives it (servecap/engine/model_runner.py). A decode stretch: launch_decode for
    its first step, launch_next(j) for step j + 1 (inputs from step j's, on the device), wait(j) until step j + 1
    has ended, stretch_result(k) for the tokens of all k launched steps, per row. A prefill step: launch_prefill,
    then prefill_result for the first tokens of the prompts it completes (it waits for the step's end). prepare:
    work for later prefill steps that the host can do while the device runs.
    `asynchronous`: launches return before the work is done (a GPU), so the timer may launch a step before it has
    read the last one's end, and do the host's other work while a step runs."""

    block_size: int
    num_blocks: int
    max_tokens: int
    asynchronous: bool

    def prepare(self, seqs: Iterable[Seq]) -> None: ...

    def launch_prefill(self, work: PrefillWork) -> None: ...

    def prefill_result(self) -> list[int]: ...

    def stretch_cap(self, rows: list[Seq]) -> int: ...

    def launch_decode(self, rows: list[Seq], backend: str) -> None: ...

    def launch_next(self, j: int) -> None: ...

    def wait(self, j: int) -> None: ...

    def stretch_result(self, steps: int) -> list[list[int]]: ...


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


AHEAD = 2  # decode steps in flight at most: the one running and the next, launched while the host reads its end
MARGIN_STEPS = 2  # a step is launched ahead only if the one before it would end this many steps' time before stop


class EngineTimer:
    """Steps take what the runner takes, timed by the clock. A pass's decode steps run as a stretch (the plan's
    bound, and while the rows' blocks hold them): on an asynchronous runner the next step is launched before the
    last one's end is read, so the host's work between steps overlaps the device's.

    The stretch keeps the step loop's contract, cut after the first step that ends at or after `stop` (an arrival
    the scheduler could admit): a step is launched ahead only while the step before it would end more than
    MARGIN_STEPS steps' time before stop at the last step's pace; otherwise the host waits for that end first. A
    step that outlasts that margin by so much that a step launched ahead was not due is still run, and counted in
    `overruns` (the run's metadata says how many).

    A pass's prefill step and its decode stretch run back to back: the stretch's first step is launched right behind
    the prefill step, its new rows' first tokens taken from that step's output on the device, so the host's work
    between the two (reading the prefill step's end and tokens, the decode step's inputs and launch) overlaps the
    device's; the prefill step's end is read from its own event.

    `while_running` is host work that waits for no step (writing the last pass's records: WriteBehind.flush): it is
    done once a pass's first step is launched, while the device runs it, instead of before."""

    fast_forward = True

    def __init__(self, runner: Runner, backend: str, clock, while_running: Callable[[], None] = lambda: None):
        self.runner, self.backend, self.clock, self.while_running = runner, backend, clock, while_running
        self.ahead = AHEAD if runner.asynchronous else 1
        self.pace: float | None = None  # the last decode step's duration
        self.overruns = 0
        self._first: list[Seq] | None = None  # the rows whose first decode step prefill() launched

    def now(self) -> float:
        return self.clock.now()

    def wait_until(self, t: float) -> None:
        self.clock.wait_until(t)

    def prefill(self, work: PrefillWork, start: float, then: list[Seq] | None = None) -> tuple[list[int], float]:
        r = self.runner
        r.launch_prefill(work)
        # The pass's first decode step right behind, no host work between the two; a synchronous runner's launch
        # runs the step, so there decode() launches it, once the prefill step's end is read.
        behind = then if then and r.asynchronous else None
        if behind:
            r.launch_decode(behind, self.backend)
        self.while_running()
        tokens = r.prefill_result()
        self._first = behind
        return tokens, self.clock.now()

    def _due(self, j: int, ends: list[float], stop: float) -> bool:
        """Whether step j + 1 runs: step j ends before stop, read, or sure to by the margin."""
        if j <= len(ends):
            return ends[j - 1] < stop
        if stop == math.inf:
            return True
        if self.pace is None:
            return False
        return self.clock.now() + (j - len(ends) + MARGIN_STEPS) * self.pace < stop

    def decode(self, rows: list[Seq], shape: DecodeShape, start: float, limit: int,
               stop: float) -> tuple[list[list[int]], list[float]]:
        r = self.runner
        limit = max(1, min(limit, r.stretch_cap(rows)))
        if self._first is not rows:  # not launched behind the pass's prefill step
            r.launch_decode(rows, self.backend)
        self._first = None
        launched, ends = 1, []
        while True:
            while launched < limit and launched - len(ends) < self.ahead and self._due(launched, ends, stop):
                r.launch_next(launched)
                launched += 1
            if not ends:
                self.while_running()
            if len(ends) == launched:
                break
            r.wait(len(ends))
            ends.append(self.clock.now())
            if ends[-1] >= stop and launched > len(ends):
                self.overruns += launched - len(ends)  # launched ahead, and not due after all: run, and counted
            if ends[-1] >= stop:
                limit = launched
        self.pace = ends[-1] - (ends[-2] if len(ends) > 1 else start)
        return r.stretch_result(launched), ends

    def retired(self, n: int) -> None:
        pass  # writing the records took real time, which the clock already shows

    def stretch_ended(self, steps: int) -> float:
        return 0.0  # reading the stretch's tokens and the rest took real time, which the clock already shows


def serve(trace: Trace | None, runner: Runner, recorder: Recorder, serving: ServingConfig,
          pool_blocks: int | None = None, clock=None, on_finish: Callable[[list[Seq]], None] | None = None,
          arrivals=None) -> tuple[Scheduler, EngineTimer]:
    """Replay `trace` (arrival times from the run's start) through the engine, or serve what `arrivals` hands
    over as it comes (a replica behind a router), with `serving`'s rows and policies; rows go to `recorder`, on an
    asynchronous runner each pass's while its next pass's first step runs (WriteBehind), and the prompts at the
    queue's head are made ready then too. Returns the scheduler and the timer, as the run left them."""
    clock = clock or WallClock()
    sched = serving.scheduler(pool_blocks or runner.num_blocks, runner.max_tokens)
    log = WriteBehind(recorder) if runner.asynchronous else recorder

    def while_running() -> None:  # host work no step waits for, done while the device runs one
        log.flush()
        runner.prepare(islice(sched.queue, serving.max_batch))
    timer = EngineTimer(runner, recorder.backend, clock, while_running)
    try:
        drive(StepLoop(sched, log, timer, arrivals or TraceArrivals(trace.requests), on_finish), timer)
    finally:  # a run cut short keeps every row it made
        log.flush()
    return sched, timer
