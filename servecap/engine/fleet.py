"""Replicas for real: one engine process per GPU, fed by a router that replays a trace in real time.

The router (this process) sleeps until each request's arrival, picks a replica by its rule, and puts the request
on that replica's queue; each replica runs the engine's own step loop, taking what its queue holds at every step
boundary (and blocking on it when idle), and tells the router as requests finish so the router's view of what
each replica has outstanding (core.routing.Load) stays current. All processes share one clock: perf_counter is
the machine's monotonic clock, and the router hands every replica the same start. Each replica writes its own run
record (replica-<i>/); `merge` joins them into the fleet's record, the schema of any other run, with the replica
column telling them apart.

Routers: servecap/core/routing.py's, the rules the simulator's fleet (servecap/sim/fleet.py) routes by: round-robin by arrival
index; least-outstanding (fewest requests routed there and not finished); least-tokens (fewest prompt + budget
tokens of those requests). A request is outstanding from its routing until its replica reports it finished.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import time
from pathlib import Path

from servecap.traces.errors import InputError
from servecap.traces.records import TABLES, RunWriter, read_run
from servecap.traces.workload import Request, Trace

from servecap.core.routing import Load, router as router_named

START_AHEAD_S = 0.5  # the router announces the start this far ahead, so every replica is waiting when it comes


class QueueArrivals:
    """A replica's view of the requests routed to it: what has arrived by t, and a blocking wait when idle."""

    foreseen = False  # a request is known only once the router has sent it

    def __init__(self, inbox: mp.Queue):
        self.inbox = inbox
        self.pending: list[Request] = []
        self.closed = False

    def _take(self, block: bool) -> None:
        try:
            while True:
                item = self.inbox.get(block=block, timeout=None)
                block = False
                if item is None:
                    self.closed = True
                else:
                    self.pending.append(Request(*item))
        except queue.Empty:
            pass

    def due(self, t: float) -> list[Request]:
        self._take(block=False)
        out = [r for r in self.pending if r.arrival <= t]
        self.pending = [r for r in self.pending if r.arrival > t]
        return out

    @property
    def exhausted(self) -> bool:
        return self.closed and not self.pending

    def next_time(self) -> float | None:
        return min((r.arrival for r in self.pending), default=None)

    def next_candidate(self, sched) -> tuple[float, None]:
        # A request may be routed here at any moment, unannounced: a decode stretch ends after its first step.
        return -float("inf"), None

    def wait(self) -> None:
        self._take(block=True)


def _replica(i: int, device: str, cfg_kwargs: dict, run_kwargs: dict, trace_meta: dict, inbox: mp.Queue,
             done: mp.Queue, out: str) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = device  # before torch starts CUDA in this process
    from .engine import Engine, EngineConfig
    from .serve import WallClock

    engine = Engine(EngineConfig(**cfg_kwargs), log=lambda m: print(f"[replica {i}] {m}", flush=True))
    done.put(("ready", i, None))
    t0 = inbox.get()  # the fleet's start, on the shared clock
    arrivals = QueueArrivals(inbox)
    engine.run(Trace([], trace_meta), Path(out) / f"replica-{i}", arrivals=arrivals, replica=i,
               clock=WallClock(t0), progress=False, on_finish=lambda ids: done.put(("finished", i, ids)),
               **run_kwargs)
    done.put(("exit", i, None))


def _next(done: mp.Queue, procs: list) -> tuple:
    """The next replica message; a replica that died without saying so (its traceback is on stderr) ends the fleet
    instead of leaving the router waiting for it forever."""
    while True:
        try:
            return done.get(timeout=1.0)
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"fleet replica(s) {dead} died (exit status "
                                   f"{[procs[i].exitcode for i in dead]}); see their output above")


def serve_fleet(trace: Trace, out: Path, router: str, devices: list[str], cfg_kwargs: dict,
                run_kwargs: dict | None = None, log=print) -> Path:
    """Run `trace` on one engine process per device behind `router`; returns the fleet's merged record."""
    pick = router_named(router)
    if not devices:
        raise InputError("a fleet needs at least one replica")
    out = Path(out)
    if (out / "meta.json").exists():
        raise InputError("already holds a run record; choose a new output directory", path=out)
    ctx = mp.get_context("spawn")
    inboxes = [ctx.Queue() for _ in devices]
    done = ctx.Queue()
    procs = [ctx.Process(target=_replica, args=(i, d, cfg_kwargs, run_kwargs or {}, trace.meta, inboxes[i], done,
                                                str(out)), daemon=True) for i, d in enumerate(devices)]
    for p in procs:
        p.start()
    ready = 0
    while ready < len(procs):
        kind, i, _ = _next(done, procs)
        ready += kind == "ready"
    t0 = time.perf_counter() + START_AHEAD_S
    for q in inboxes:
        q.put(t0)
    loads = [Load() for _ in devices]
    where: dict[int, int] = {}
    by_id = {r.request_id: r for r in trace.requests}
    exited = 0

    def take(kind: str, i: int, ids) -> None:
        """One message from a replica: the requests it finished leave its load."""
        nonlocal exited
        if kind == "finished":
            for rid in ids:
                loads[i].remove(by_id[rid])
        exited += kind == "exit"

    def drain() -> None:
        while True:
            try:
                take(*done.get_nowait())
            except queue.Empty:
                return

    for turn, req in enumerate(sorted(trace.requests, key=lambda r: r.arrival)):
        while (left := t0 + req.arrival - time.perf_counter()) > 0:
            time.sleep(min(left, 1e-3))
            drain()
        drain()
        i = pick(loads, turn)
        where[req.request_id] = i
        loads[i].add(req)
        inboxes[i].put((req.request_id, req.arrival, req.prompt_tokens, req.budget, req.prompt))
    for q in inboxes:
        q.put(None)
    while exited < len(procs):
        take(*_next(done, procs))
    for p in procs:
        p.join()
    log(f"fleet of {len(devices)} ({router}) served {len(where)} requests")
    return merge(out, len(devices), {"router": router, "replicas": len(devices), "devices": devices,
                                     "trace_id": trace.trace_id})


def merge(out: Path, replicas: int, fleet_meta: dict) -> Path:
    """The replicas' records as one run record in `out` (rows in replica order), meta from replica 0's."""
    recs = [read_run(Path(out) / f"replica-{i}") for i in range(replicas)]
    meta = {**recs[0].meta, **fleet_meta, "replica_meta": [r.meta for r in recs]}
    for k in ("status", "ended_at", "schema", "version"):
        meta.pop(k, None)
    writer = RunWriter(out, meta)
    for t in TABLES:
        for r in recs:
            writer.add_many(t, getattr(r, t).itertuples(index=False, name=None))
    writer.close()
    for i in range(replicas):  # every row is in the fleet's record now
        shutil.rmtree(Path(out) / f"replica-{i}")
    return Path(out)
