"""A fleet: N replicas of the engine behind a router, in one SimPy simulation, written to one run record.

Each replica is one engine as sim.simulator runs it: its own scheduler, block pool, batch rows, recorder
(replica=i) and the engine's step loop on a SimTimer. The router is a SimPy process that receives the trace's
arrivals at their times and pushes each into one replica's inbox (servecap/core/routing.py picks which, from what each
replica has outstanding at that moment). A replica's loop reads its inbox as its arrivals; idle with an empty
inbox, it cannot know when work will come, so the loop yields None and the replica's process waits for the router
to wake it.

Time and ties. The loops keep exact clocks of their own, and SimPy's clock is set to those floats exactly
(FleetEnv.at), so an arrival at the very end of a step is ordered as one engine orders it: at any instant the
router acts first, so a request that arrives exactly when a pass begins is in that pass (TraceArrivals.due(t)
takes arrivals <= t). Rows that finish at the end of a pass are retired, and their records written, when the loop
resumes, which costs the table's retire_s per row: the replica's next pass begins then, so its process sleeps
until that moment, and requests that arrive meanwhile are in that pass, as on one engine.

Stretches. A replica does not foresee its arrivals (Inbox.foreseen): a request may be routed to it at any moment,
so, as the engine's replica behind a router does (servecap/engine/fleet.py), a decode stretch with a row free ends
after its first step, the engine launching no step ahead past it, and each such end is charged
(servecap/core/step_loop.py); with every row busy no admission can come, and a stretch runs on to its bound. So with a
table fitted with the stretch-end term a replica costs more a step than one engine replaying a trace, whose
lookahead knows when the next request comes; with a table without it, a fleet of one replica writes exactly the
records simulate() writes.
"""
from __future__ import annotations

import heapq
import math
import time
from collections import deque
from typing import Callable

import simpy
from simpy.events import NORMAL, URGENT

from servecap.costs.model import CostModel
from servecap.core.recorder import Recorder
from servecap.core.routing import Load, Router, router as router_named
from servecap.core.scheduler import Scheduler, Seq
from servecap.core.step_loop import StepLoop
from servecap.traces.records import RunWriter
from servecap.traces.workload import Request, Trace

from .simulator import SimConfig, SimResult, SimTimer, _Noise, start_run


class FleetEnv(simpy.Environment):
    def at(self, t: float, priority: int = NORMAL) -> simpy.Event:
        """An event at time t exactly (not before now). A timeout of t - now lands on now + (t - now), which can
        round away from t, and ties between an arrival and a step's end must be decided on the loops' own floats."""
        event = simpy.Event(self)
        event._ok, event._value = True, None  # born triggered, as SimPy's own Timeout is
        heapq.heappush(self._queue, (max(t, self._now), priority, next(self._eid), event))
        return event


class ReplicaTimer(SimTimer):
    """SimTimer for replica i: its own noise streams (replica 0 draws what one engine draws)."""

    def __init__(self, cost: CostModel, backend: str, fast_forward: bool, noise_seed: int | None, replica: int,
                 policy: str = "padded"):
        super().__init__(cost, backend, fast_forward, noise_seed, policy)
        if noise_seed is not None and replica:
            self.noise = (_Noise(noise_seed, 2 * replica, cost.prefill_sigma),
                          _Noise(noise_seed, 2 * replica + 1, cost.decode_sigma[backend]))


class ReplicaRecorder(Recorder):
    """A replica's recorder, which also takes each request it retires or refuses off the load the router sees."""

    def __init__(self, writer: RunWriter, backend: str, load: Load, replica: int, detail: str):
        super().__init__(writer, backend, tokens=detail == "tokens", decode_steps=detail != "summary", replica=replica)
        self.load = load

    def finish(self, seqs: list[Seq]) -> None:
        super().finish(seqs)
        for s in seqs:
            self.load.remove(s.req)

    def reject(self, req: Request, reason: str) -> None:
        super().reject(req, reason)
        self.load.remove(req)


class Dispatcher:
    """The router as a SimPy process: each arrival at its time, to the replica the policy picks."""

    def __init__(self, env: FleetEnv, requests: list[Request], pick: Router, replicas: int):
        self.env, self.pick = env, pick
        self.loads = [Load() for _ in range(replicas)]
        self.inboxes = [Inbox(env) for _ in range(replicas)]
        self.pending = sorted(requests, key=lambda r: r.arrival)

    def run(self):
        for i, req in enumerate(self.pending):
            if req.arrival > self.env.now:
                yield self.env.at(req.arrival, URGENT)  # before any replica's pass at the same instant
            j = self.pick(self.loads, i)
            self.loads[j].add(req)
            self.inboxes[j].push(req)
        for inbox in self.inboxes:
            inbox.close()


class Inbox:
    """A replica's arrivals as the step loop reads them: the requests the router has pushed to it, known only once
    pushed, as the engine's replica knows them (servecap/engine/fleet.py QueueArrivals)."""

    foreseen = False

    def __init__(self, env: FleetEnv):
        self.env = env
        self.queue: deque[Request] = deque()
        self.closed = False
        self._wake: simpy.Event | None = None

    def push(self, req: Request) -> None:
        self.queue.append(req)
        self._notify(req.arrival)

    def close(self) -> None:
        """No more requests will come."""
        self.closed = True
        self._notify(None)

    def _notify(self, value: float | None) -> None:
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed(value)

    def wait(self) -> simpy.Event:
        """An event the router triggers with the time of the next request it pushes (None when it closes)."""
        self._wake = self.env.event()
        return self._wake

    def due(self, t: float) -> list[Request]:
        out = []
        while self.queue and self.queue[0].arrival <= t:
            out.append(self.queue.popleft())
        return out

    @property
    def exhausted(self) -> bool:
        return self.closed and not self.queue

    def next_time(self) -> float | None:
        """The next pushed arrival's time; None when nothing is queued (when the next one comes is not known)."""
        return self.queue[0].arrival if self.queue else None

    def next_candidate(self, sched: Scheduler) -> tuple[float, None]:
        """At once, as the engine's replica answers: a request may be routed here at any moment, unannounced, so a
        decode stretch with a row free ends after its first step."""
        return -math.inf, None


def _replica(env: FleetEnv, loop: StepLoop, timer: ReplicaTimer, inbox: Inbox):
    """A replica's loop as a SimPy process."""
    for t in loop.run():
        if t is None:  # idle, and nothing pushed yet
            arrival = yield inbox.wait()
            if arrival is not None:
                timer.wait_until(arrival)
            continue
        # The rows sched.retire() takes when the loop resumes; their records cost retire_s each, then the next
        # pass begins, so the replica sleeps until then and the router sees them outstanding until then.
        finishing = sum(1 for s in loop.sched.running if s.remaining <= 0)
        yield env.at(timer.after_retiring(finishing) if finishing else t)
        timer.wait_until(t)


def simulate_fleet(trace: Trace, cost: CostModel, cfg: SimConfig = SimConfig(),
                   on_finish: Callable[[int], None] | None = None) -> SimResult:
    """Run `trace` through cfg.serving.replicas engines behind its router, on simulated time; one record of the
    engine's schema, each row with its replica (steps and passes in the result are the fleet's). `on_finish(n)` is
    called as rows retire, as simulate() calls it."""
    serving = cfg.serving
    replicas, router = serving.replicas, serving.router
    pick = router_named(router)
    t0 = time.perf_counter()
    pool_blocks, writer = start_run(trace, cost, cfg, replicas=replicas, router=router)
    env = FleetEnv()
    dispatcher = Dispatcher(env, trace.requests, pick, replicas)
    env.process(dispatcher.run())  # first: arrivals at t=0 are in the inboxes before any replica's first pass
    loops, timers = [], []
    for i, inbox in enumerate(dispatcher.inboxes):
        sched = serving.scheduler(pool_blocks, serving.max_positions)
        timer = ReplicaTimer(cost, serving.backend, cfg.fast_forward, cfg.noise_seed, i, str(serving.prefill))
        recorder = ReplicaRecorder(writer, serving.backend, dispatcher.loads[i], i, cfg.detail)
        loop = StepLoop(sched, recorder, timer, inbox, (lambda done: on_finish(len(done))) if on_finish else None)
        env.process(_replica(env, loop, timer, inbox))
        loops.append(loop)
        timers.append(timer)
    env.run()
    steps = sum(t.prefills + t.decodes for t in timers)
    passes = sum(loop.passes for loop in loops)
    writer.close(sim_steps=steps, sim_passes=passes)
    return SimResult(writer.record(), pool_blocks, steps, passes, time.perf_counter() - t0)
