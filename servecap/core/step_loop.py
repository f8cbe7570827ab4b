"""The engine's step loop, written once: the real engine and the simulator both run it.

One pass, top to bottom: take the arrivals that are due (refusing what the engine could never serve); ask the
scheduler for the pass's plan (Scheduler.schedule: the admission group, at most one prefill step, and a stretch of
decode steps of the same rows); run the plan's steps on the timer; let their time pass; retire the rows that
finished and write the pass's records. What a step costs is the timer's business: the engine's timer runs the
model on the GPU and reads the clock, a stretch of decode steps launched one step ahead of the device; the
simulator's returns the cost model's durations on its own clock and may price a whole stretch at once
(fast-forward); both up to the bound the plan sets.

The loop is a generator of times: it yields a time whenever the driver must let time pass before it goes on
(the end of a pass's steps, or the next arrival when idle; None when the next arrival is not known, as for a
replica fed by a router). The engine's driver (drive) sleeps until then (a no-op for work already done); the
simulator's, the same function, sets its virtual clock; a simulated fleet's replicas wait in SimPy processes.
Rows retire once that time has passed, so anything that looks at the scheduler from outside (a router) sees a
row outstanding until its replica's clock has reached the end of its last step and it has retired.

Steps tile the busy time: a pass that follows straight on from another starts where that one's last step ended
(after its rows retired), so the host work in between (retirement, the next pass's own bookkeeping and first
launch) is inside the next step's time, not in a gap between steps that no step's cost would hold. The engine writes
a pass's records while the next pass's first step runs on the device (servecap/core/recorder.py WriteBehind), so
that work is not in between; the simulator's clock does not move while it writes, so it is the same loop.

A stretch of decode steps ends where the pass after it plans other work than decoding the same rows on (a prompt to
compute, an admission, a preemption) or its rows retired (Scheduler.stretch_goes_on): there the engine's host does
the stretch's end (reading its tokens, retiring, planning) while the device waits, and the loop charges it
(StepTimer.stretch_ended: the simulator's cost model prices it; the engine's clock has already shown it) before the
next pass takes its arrivals, on the stretch's last decode step, where the engine's records hold it. A pass that
only goes on decoding the same rows is the same stretch: so stepping one decode step a pass and fast-forwarding
charge the same ends. Where the arrivals are not foreseen (a replica behind a router learns of a request only as it
comes), the scheduler cuts a stretch after its first step wherever a request would be admitted the moment it came
(the queue empty, a row free: Scheduler.next_admission is at once), the engine launches no step ahead past it, and
that pass's stretch ends: charged; with every row busy a replica's stretch goes on as one fed by a trace. (The
engine also ends a pass where its stretch was cut at an arrival that no longer fits, under on-demand admission, and
every STRETCH_STEPS steps: those ends are not charged.)

Step numbers: a pass's first step has the pass's number; its prefill step (if any) and its first decode step
both carry it, and its k decode steps take k consecutive numbers, so the next pass is numbered max(k, 1) on.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Callable, Iterator, Protocol, Sequence

from servecap.costs.shapes import DecodeShape
from servecap.traces.errors import InputError
from servecap.traces.workload import Request

from .scheduler import Lookahead, PrefillWork, Scheduler, Seq


class RunLog(Protocol):
    """Where a run's rows go (core.recorder.Recorder). Invariants: every submitted request ends in exactly one of
    finish() (once, when it retires) or reject() (once, on arrival); steps are written in step order per replica,
    each once, after the step has ended."""

    tokens: bool  # keep every token's time (and id)
    keep_decode: bool  # write a row per decode step (else only requests and prefill steps)

    def prefill(self, step: int, work: PrefillWork, n_admitted: int, n_preempted: int, start: float,
                end: float) -> None: ...

    def decode_steps(self, step: int, shape: DecodeShape, start: float, ends: list[float], retired: int,
                     n_preempted: int, next_start: float) -> None: ...

    def finish(self, seqs: list[Seq]) -> None: ...

    def reject(self, req: Request, reason: str) -> None: ...


class Arrivals(Lookahead, Protocol):
    """The requests a loop serves, as it sees them at each pass's start, and the scheduler's lookahead. Invariants:
    due(t) hands each request over once, in arrival order, and only once its arrival is <= t; exhausted is final;
    next_candidate keeps the Lookahead's."""

    foreseen: bool  # when requests will come is known ahead (a trace); not for a replica fed by a router

    def due(self, t: float) -> list[Request]: ...

    @property
    def exhausted(self) -> bool:
        """No request will come any more."""

    def next_time(self) -> float | None:
        """When the next request comes (when idle); None when that is not known yet (then wait())."""

    def wait(self):
        """Block (or, in SimPy, an event to yield) until a request comes or none ever will."""


class StepTimer(Protocol):
    """How long steps take, and when it is now. Invariants: now() never goes back; a step's end is at or after
    its start; decode() returns between 1 and `limit` ends, in order, cut only after the first end >= stop.
    Every step reaches the timer in order with its start, so a timer may price a step in its serving context: the
    kind of the step before it and the idle gap since that one ended (servecap/sim/simulator.py's SimTimer, servecap/costs/context.py)."""

    fast_forward: bool  # decode() may run more than one step

    def now(self) -> float: ...

    def wait_until(self, t: float) -> None: ...

    def prefill(self, work: PrefillWork, start: float, then: list[Seq]) -> tuple[list[int] | None, float]:
        """Run (or price) the step from `start`: the first tokens of the prompts it completes (None when not
        computed) and the time it ends. `then`: the rows of the decode stretch that follows in the pass (decode()
        gets the same list), whose first step an engine may launch right behind this one."""

    def decode(self, rows: list[Seq], shape: DecodeShape, start: float, limit: int,
               stop: float) -> tuple[list[list[int]] | None, list[float]]:
        """Decode steps from `start`: each row's tokens, one a step (None when not computed), and each step's end.
        One step, or up to `limit` of them, ending with the first that ends at or after `stop` (the engine's may run
        one launched ahead past it when a step far outlasts the last, and counts it: servecap/engine/serve.py)."""

    def retired(self, n: int) -> None:
        """n rows were retired and their records written (the simulator's clock moves past the cost)."""

    def stretch_ended(self, steps: int) -> float:
        """The decode stretch of `steps` steps that the last pass ran ended: the seconds its end took that the clock
        has not shown yet (the simulator's, moved past them; 0 for a clock that ran them)."""


class TraceArrivals:
    """A trace's requests as the loop sees them: due ones at each step boundary, and what is coming next."""

    foreseen = True

    def __init__(self, requests: Sequence[Request]):
        self.pending = sorted(requests, key=lambda r: r.arrival)
        self.i = 0
        self._candidate = (-1, (math.inf, None))  # (i, next_candidate's answer from i on)

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

    def wait(self) -> None:
        raise RuntimeError("a trace's next arrival is always known: a loop on a trace never waits for one")

    def next_candidate(self, sched: Scheduler) -> tuple[float, Request | None]:
        """The next pending request the scheduler would accept (requests it refuses change nothing), or never."""
        # Whether the scheduler accepts a request changes only when it accepts another (a repeated id), which
        # happens only as i moves on; so the search is done once per i, not once per pass.
        i, found = self._candidate
        if i != self.i:
            p, k = self.pending, self.i
            while k < len(p):  # by index: a slice would copy the rest of the trace
                try:
                    sched.check(p[k])
                    break
                except InputError:  # it will be refused on arrival and change nothing
                    k += 1
            found = (math.inf, None) if k == len(p) else (p[k].arrival, p[k])
            self._candidate = (self.i, found)
        return found


class StepLoop:
    def __init__(self, sched: Scheduler, recorder: RunLog, timer: StepTimer, arrivals: Arrivals,
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
        keep_times, keep_decode = rec.tokens, rec.keep_decode
        lookahead = arrivals if timer.fast_forward else None
        step = 0  # the next pass's number
        t = timer.now()  # the next pass's start
        stretch = 0  # the decode steps of the stretch the last pass ran (0: it ran none)
        retired = False  # the last pass retired rows
        cut = False  # the last pass's stretch was cut for a request that may come unforeseen (below)
        written = None  # writes the last pass's decode steps once the next pass's start is known
        while True:
            due = arrivals.due(t)
            if due:
                self._submit(due)
            # The last pass's stretch ends unless this pass only decodes the same rows on: its end is the engine's,
            # before this pass, which then starts again and takes what arrived meanwhile too.
            if stretch and (retired or cut or not sched.stretch_goes_on()):
                extra = timer.stretch_ended(stretch)
                stretch = 0
                if extra:
                    t += extra
                    yield t
                    continue
            if written is not None:  # the last of them ends where this pass starts (its retirement, its end)
                written(t)
                written = None
            if sched.idle:
                if arrivals.exhausted:
                    return
                yield arrivals.next_time()
                t = timer.now()
                continue
            # The plan (a StepPlan, its fields read once; its step is `step`): the admission group, the prefill step,
            # the decode stretch's rows, first shape and bound.
            self.passes += 1
            _, group, work, first, rows, shape, limit, stop, preempted = sched.schedule(t, step, lookahead)
            # Asked here, not read from the plan's stop: a stepping timer's plan is one step long and never asks, and
            # stepping must charge the ends that fast-forwarding does.
            cut = bool(rows) and not arrivals.foreseen and sched.next_admission(arrivals) == -math.inf
            # Run its prefill step: the prompts it completes have their first token at its end.
            if work is not None:
                tokens, end = timer.prefill(work, t, rows)
                for s in first:
                    s.last_token = end
                    if s.generated == 1:
                        s.first_token = end
                if tokens is not None:
                    for s, tok in zip(first, tokens):
                        s.token_ids.append(tok)
                if keep_times:
                    for s in first:
                        s.token_times.append(end)
                rec.prefill(step, work, len(group), len(preempted), t, end)
                t = end
            # Run its decode stretch.
            ends = None
            if rows:
                tokens, ends = timer.decode(rows, shape, t, limit, stop)
                sched.advance(rows, ends[-1], len(ends))
                stretch += len(ends)
                if tokens is not None:
                    for s, toks in zip(rows, tokens):
                        s.token_ids.extend(toks)
                if keep_times:
                    for s in rows:
                        s.token_times.extend(ends)
            # Let the steps' time pass, then retire the rows that finished (retirement costs the timer's time);
            # the next pass starts then.
            yield ends[-1] if ends else t
            done = sched.retire()
            retired = bool(done)
            if done:
                rec.finish(done)
                timer.retired(len(done))
                if self.on_finish:
                    self.on_finish(done)
            if ends and keep_decode:
                written = partial(rec.decode_steps, step, shape, t, ends, len(done),
                                  0 if work is not None else len(preempted))
            t = timer.now()
            step += len(ends) if ends else 1


def drive(loop: StepLoop, timer: StepTimer) -> None:
    """Run a loop to the end on a clock that can wait (the engine's wall clock, or a virtual one); when the loop
    cannot know when the next request comes (a replica fed by a router), its arrivals wait for one."""
    for t in loop.run():
        if t is None:
            loop.arrivals.wait()
        else:
            timer.wait_until(t)

