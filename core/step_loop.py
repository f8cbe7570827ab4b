"""The engine's step loop, written once: the real engine and the simulator both run it.

One pass: submit the arrivals that are due (refusing what the engine could never serve), admit a group, run the
prefill step the policy asks for, run decode for every row that has its first token, retire finished rows and
record everything. What a step costs is the timer's business: the engine's timer runs the model on the GPU and
reads the clock; the simulator's returns the cost model's durations on its own clock and may price a whole
stretch of decode steps at once (fast-forward), up to the first point where the scheduler has something to
decide: a row finishing, a prompt waiting for its next chunk, or the next arrival that could be admitted.

The loop is a generator of times: it yields a time whenever the driver must let time pass before it goes on
(the end of a pass's work, or the next arrival when idle; None when the next arrival is not known, as for a
replica fed by a router). The engine's driver (drive) sleeps until then (a no-op for work already done); the
simulator's, the same function, sets its virtual clock; a simulated fleet's replicas wait in SimPy processes.
Rows finish at the yielded time, after the wait, so anything that looks at the scheduler from outside (a router)
sees it as it is at that moment.
"""
from __future__ import annotations

import math
from typing import Callable, Iterator, Protocol, Sequence

from costs.shapes import DecodeShape
from traces.errors import InputError
from traces.workload import Request

from .recorder import Recorder
from .scheduler import PrefillWork, Scheduler, Seq, decode_shape


class StepTimer(Protocol):
    """How long steps take, and when it is now."""

    fast_forward: bool  # decode() may run more than one step

    def now(self) -> float: ...

    def wait_until(self, t: float) -> None: ...

    def prefill(self, work: PrefillWork, start: float) -> tuple[list[int] | None, float]:
        """Run (or price) the step from `start`: the first tokens of the prompts it completes (None when not
        computed) and the time it ends."""

    def decode(self, rows: list[Seq], shape: DecodeShape, start: float, limit: int,
               stop: float) -> tuple[list[int] | None, list[float]]:
        """Decode steps from `start`: the next token of each row (None when not computed) and each step's end.
        One step, or up to `limit` of them, ending with the first that ends at or after `stop`."""

    def retired(self, n: int) -> None:
        """n rows were retired and their records written (the simulator's clock moves past the cost)."""


class TraceArrivals:
    """A trace's requests as the loop sees them: due ones at each step boundary, and what is coming next."""

    def __init__(self, requests: Sequence[Request]):
        self.pending = sorted(requests, key=lambda r: r.arrival)
        self.i = 0
        self._acceptable = (-1, 0)  # (i, the first pending request from i that the scheduler accepts)

    def due(self, t: float) -> list[Request]:
        i = j = self.i
        p, n = self.pending, len(self.pending)
        while j < n and p[j].arrival <= t:
            j += 1
        self.i = j
        return p[i:j]

    @property
    def exhausted(self) -> bool:
        return self.i == len(self.pending)

    def next_time(self) -> float:
        return self.pending[self.i].arrival

    def next_admission(self, sched: Scheduler) -> float:
        """The earliest time an admission can happen before the running rows change: the arrival of the next
        request the scheduler would accept, if a row is free and it fits in the free blocks; else never."""
        if sched.queue or len(sched.running) >= sched.max_batch:  # a head waiting for blocks, or no free row
            return math.inf
        p = self.pending
        # Whether the scheduler accepts a request changes only when it accepts another (a repeated id), which
        # happens only as i moves on; so the search is done once per i, not once per pass.
        i, k = self._acceptable
        if i != self.i:
            k = self.i
            while k < len(p):  # by index: a slice would copy the rest of the trace
                try:
                    sched.check(p[k])
                    break
                except InputError:  # it will be refused on arrival and change nothing
                    k += 1
            self._acceptable = (self.i, k)
        if k == len(p):
            return math.inf
        req = p[k]
        fits = sched.pool.blocks_for(req.prompt_tokens + req.budget) <= sched.pool.free
        return req.arrival if fits else math.inf  # one that does not fit blocks everything behind it


class StepLoop:
    def __init__(self, sched: Scheduler, recorder: Recorder, timer: StepTimer, arrivals,
                 on_finish: Callable[[list[Seq]], None] | None = None):
        self.sched, self.rec, self.timer, self.arrivals, self.on_finish = sched, recorder, timer, arrivals, on_finish
        self.passes = 0  # passes that did work

    def _submit(self, reqs: list[Request]) -> None:
        for req in reqs:
            try:
                self.sched.submit(req)
            except InputError as e:  # a bad request is refused and recorded; the run goes on
                self.rec.reject(req, str(e))

    def run(self) -> Iterator[float | None]:
        sched, rec, timer, arrivals = self.sched, self.rec, self.timer, self.arrivals
        keep_times, keep_decode, fast_forward = rec.tokens, rec.keep_decode, timer.fast_forward
        step = 0
        stretch = None  # the last decode stretch's steps, when kept; the last of them ends where the next pass starts
        while True:
            t = timer.now()
            if stretch is not None:
                rec.decode_steps(*stretch, t)
                stretch = None
            due = arrivals.due(t)
            if due:
                self._submit(due)
            if sched.idle:
                if arrivals.exhausted:
                    return
                yield arrivals.next_time()
                continue
            self.passes += 1
            start = t
            group = sched.admit(t, step)
            work = sched.prefill_work()
            if work is not None:
                tokens, t = timer.prefill(work, start)
                first_tokens = sched.prefilled(work, t)
                if tokens is not None:
                    for i, s in enumerate(first_tokens):
                        s.token_ids.append(tokens[i])
                if keep_times:
                    for s in first_tokens:
                        s.token_times.append(t)
                rec.prefill(step, work, len(group), start, t)
            rows = sched.decode_rows()
            k = 0
            if rows:
                shape = decode_shape(rows)
                limit = sched.max_decode_steps()
                stop = arrivals.next_admission(sched) if limit > 1 and fast_forward else math.inf
                tokens, ends = timer.decode(rows, shape, t, limit, stop)
                k = len(ends)
                decode_start, t = t, ends[-1]
                sched.advance(rows, t, k)
                if tokens is not None:
                    for s, tok in zip(rows, tokens):
                        s.token_ids.append(tok)
                if keep_times:
                    for s in rows:
                        s.token_times.extend(ends)
            yield t
            done = sched.retire()
            if done:
                rec.finish(done)
                timer.retired(len(done))
                if self.on_finish:
                    self.on_finish(done)
            if rows and keep_decode:
                stretch = (step, shape, decode_start, ends, len(done))
            step += max(k, 1)


def drive(loop: StepLoop, timer: StepTimer) -> None:
    """Run a loop to the end on a clock that can wait (the engine's wall clock, or a virtual one); when the loop
    cannot know when the next request comes (a replica fed by a router), its arrivals wait for one."""
    for t in loop.run():
        if t is None:
            loop.arrivals.wait()
        else:
            timer.wait_until(t)

