"""A real run replayed through the simulator's scheduler and step loop, every step taking exactly the time the
engine's took: what the simulator would predict if its cost model were perfect.

The replay separates the two things a prediction can get wrong. Where it reproduces the engine's steps and every
request's times, scheduling, admission, the stretches' cut at an arrival and retirement are the engine's own, and
all that is left between a prediction and the run is what the steps cost. Where it does not, it names the first
step where the scheduler asked for another step than the engine ran.

RecordedTimer is the step loop's timer (servecap/core/step_loop.py StepTimer) that hands out the record's steps in
order, checking each against the one the scheduler asks for (its kind, rows and positions computed). Three things
the engine's clock did besides its steps are taken from the record as well, while the replay is in step with it:
- when the engine started a pass after waiting (for the first arrival, or after idle), a little after the arrival
  (its wake-up): the record's start of the pass's first step;
- a decode step run past an admissible arrival (launched ahead, and not due after all: the run's
  `decode_overruns`), as many as the record counts;
- retirement: a decode step that retires rows is recorded ending where the next pass starts, after their
  retirement, while their finish is the step's own end (the requests' `finished`); the replay ends the step there
  and lets retirement take the rest.
Nothing else: steps tile the busy time, so a step's start is the last one's end (in records made before they did,
a decode step starts at its recorded start, after the host's gap).
Fleets are not replayed (their router's timing is another process's); a record of one engine is.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from servecap.core.block_pool import PoolSize
from servecap.core.config import ServingConfig
from servecap.core.recorder import Recorder
from servecap.core.scheduler import PrefillWork, Seq
from servecap.core.step_loop import StepLoop, TraceArrivals, drive
from servecap.costs.shapes import DecodeShape
from servecap.traces.errors import InputError
from servecap.traces.model_spec import MODELS, config_hash
from servecap.traces.records import RunRecord, RunWriter
from servecap.traces.workload import Trace

TIMES = ("admitted", "first_token", "finished")  # each request's times the replay is held to
SAME_S = 1e-6  # times within this of the record's are the same (sums of the same durations, in another order)


@dataclass(frozen=True)
class Divergence:
    """The first recorded step the scheduler did not ask for: its index among the record's steps (by start), what
    the engine ran and what the scheduler asked for."""

    index: int
    start: float
    recorded: str
    asked: str


class RecordedTimer:
    """Steps take the recorded time of the record's next step (module docstring)."""

    fast_forward = True

    def __init__(self, steps: pd.DataFrame, finished: np.ndarray, overruns: int = 0):
        s = steps.sort_values(["start", "step"], kind="stable")
        self._kind = s.kind.to_list()
        self._rows = s.rows.astype(int).to_list()
        self._tokens = s.tokens.astype(int).to_list()
        self._start = s.start.astype(float).to_list()
        start, end = s.start.to_numpy(float), s.end.to_numpy(float)
        # A step that retired rows ends at their finish, the last finish inside it; retirement takes the rest.
        finished = np.sort(np.asarray(finished, float)[np.isfinite(finished)])
        j = np.searchsorted(finished, end, side="right") - 1
        own = np.where(j >= 0, finished[np.maximum(j, 0)], -np.inf)
        retiring = (s.kind == "decode").to_numpy() & (s.retired > 0).to_numpy() & (own >= start)
        token_end = np.where(retiring, own, end)
        self._dur = (token_end - start).tolist()
        self._retire = (end - token_end).tolist()
        self._retiring = 0.0  # the last step's retirement, taken when the loop retires its rows
        self.i = 0  # the next recorded step
        self.t = 0.0
        self.overruns = overruns  # past-stop decode steps the record still holds
        self.divergence: Divergence | None = None

    @property
    def in_step(self) -> bool:
        return self.divergence is None

    @property
    def recorded(self) -> int:
        """The record's steps."""
        return len(self._dur)

    def now(self) -> float:
        # A pass starting after a wait starts when the engine woke, once the replay is at that step.
        if self.in_step and self.i < len(self._start) and self._start[self.i] > self.t:
            self.t = self._start[self.i]
        return self.t

    def wait_until(self, t: float) -> None:
        if t > self.t:
            self.t = t

    def _take(self, kind: str, rows: int, tokens: int | None) -> float:
        i = self.i
        if i >= len(self._dur):  # out of step, the scheduler asks for more than the engine ran: the last step's
            self._diverge(i, math.inf, "no step", kind, rows, tokens)  # time again, so that the replay ends
            return self._dur[-1] if self._dur else 0.0
        self.i += 1
        self._retiring = self._retire[i]
        k, r, n = self._kind[i], self._rows[i], self._tokens[i]
        if (k == "decode") != (kind == "decode") or r != rows or (tokens is not None and n != tokens):
            self._diverge(i, self._start[i], _describe(k, r, n if k != "decode" else None), kind, rows, tokens)
        return self._dur[i]

    def _diverge(self, i: int, start: float, recorded: str, kind: str, rows: int, tokens: int | None) -> None:
        if self.divergence is None:
            self.divergence = Divergence(i, start, recorded, _describe(kind, rows, tokens))

    def prefill(self, work: PrefillWork, start: float, then: list[Seq]) -> tuple[None, float]:
        self.t = start + self._take(work.kind, len(work.seqs), sum(work.computed))
        return None, self.t

    def _next_is_decode(self, rows: int) -> bool:
        return self.i < len(self._kind) and self._kind[self.i] == "decode" and self._rows[self.i] == rows

    def decode(self, rows: list[Seq], shape: DecodeShape, start: float, limit: int,
               stop: float) -> tuple[None, list[float]]:
        n, t, ends = len(rows), start, []
        while True:
            if self.in_step and self.i < len(self._start):  # a gap before the step: the host's work, in records
                t = max(t, self._start[self.i])  # made before steps tiled the busy time
            t += self._take("decode", n, None)
            ends.append(t)
            if len(ends) == limit or not self._next_is_decode(n):
                break
            if t >= stop:  # the engine's step launched ahead past an admissible arrival, as the record counts
                if not (self.in_step and self.overruns):
                    break
                self.overruns -= 1
        self.t = ends[-1]
        return None, ends

    def retired(self, n: int) -> None:
        self.t += self._retiring
        self._retiring = 0.0

    def stretch_ended(self, steps: int) -> float:
        return 0.0  # in the recorded step's time (it ends where the next pass starts)


def _describe(kind: str, rows: int, tokens: int | None) -> str:
    return f"{kind} of {rows} row(s)" + ("" if tokens is None else f", {tokens} positions")


def serving_of(meta: dict, path: object = None) -> tuple[ServingConfig, int, int | None]:
    """The serving configuration a record's engine ran, its pool's blocks and its most positions a request, from
    its meta.json (`path`: the record, for a refusal's message)."""
    if int(meta.get("replicas", 1) or 1) > 1:
        raise InputError("is a fleet's record; a replay takes one engine's", path=path)
    missing = [k for k in ("backend", "prefill", "max_batch", "pool_blocks") if k not in meta]
    if missing:
        raise InputError(f"meta.json lacks {', '.join(missing)}: not an engine's run record", path=path)
    model = meta.get("model") or {}
    names = [k for k, spec in MODELS.items() if config_hash(spec) == model.get("config_hash")]
    serving = ServingConfig(model=names[0] if names else ServingConfig.model, dtype=model.get("dtype", "float16"),
                            block_size=int(meta.get("block_size", 64)), max_batch=int(meta["max_batch"]),
                            pool=PoolSize(blocks=int(meta["pool_blocks"])), backend=meta["backend"],
                            prefill=meta["prefill"], admission=meta.get("admission", "reserve"),
                            prefix_cache=bool(meta.get("prefix_cache", False)),
                            max_num_batched_tokens=meta.get("max_num_batched_tokens"))
    return serving, int(meta["pool_blocks"]), meta.get("max_tokens")


@dataclass(frozen=True)
class Replay:
    """A replay's outcome: the recorded steps it used and the record's count, the first divergence (None: every
    step as the engine ran it), and per request its recorded and replayed times (TIMES, `_replay` suffixed)."""

    used: int
    recorded: int
    divergence: Divergence | None
    requests: pd.DataFrame

    def error_s(self, column: str) -> float:
        """The largest |replayed - recorded| of a request time (NaN where no request has both)."""
        d = (self.requests[f"{column}_replay"] - self.requests[column]).abs()
        return float(d.max()) if d.notna().any() else math.nan

    @property
    def identical(self) -> bool:
        """Every step as the engine ran it, and every request's times within SAME_S of the record's."""
        return (self.divergence is None and self.used == self.recorded
                and all(not self.error_s(c) > SAME_S for c in TIMES))  # NaN: no request has both, nothing differs

    def ttft_p50(self) -> tuple[float, float]:
        """TTFT p50, recorded and replayed (seconds)."""
        r = self.requests
        return (float(np.nanmedian(r.first_token - r.arrival)),
                float(np.nanmedian(r.first_token_replay - r.arrival)))


def _check_same_requests(rec: RunRecord, trace: Trace, path: object) -> None:
    """The trace is the one the run served: every recorded request is in it, arriving when the record says."""
    arrivals = {r.request_id: r.arrival for r in trace.requests}
    for rid, arrival in zip(rec.requests.request_id.tolist(), rec.requests.arrival.tolist()):
        theirs = arrivals.get(int(rid))
        if theirs is None or abs(theirs - arrival) > SAME_S:
            where = "is not in the trace" if theirs is None else f"arrives at {theirs:.6f} s in the trace"
            raise InputError(f"is not the trace this run served: its request {int(rid)} {where}, at {arrival:.6f} s "
                             "in the record", path=path)


def replay(rec: RunRecord, trace: Trace, run_path: object = None, trace_path: object = None) -> Replay:
    """Replay `rec` (one engine's complete record) with its trace's requests through the configuration it ran; the
    paths name the two in a refusal."""
    serving, pool_blocks, max_tokens = serving_of(rec.meta, run_path)
    _check_same_requests(rec, trace, trace_path)
    writer = RunWriter(None, {"kind": "replay"}, ("requests", "steps", "rejected"))
    timer = RecordedTimer(rec.steps, rec.requests.finished.to_numpy(float),
                          int(rec.meta.get("decode_overruns", 0) or 0))
    sched = serving.scheduler(pool_blocks, max_tokens)
    drive(StepLoop(sched, Recorder(writer, serving.backend, tokens=False, decode_steps=False), timer,
                   TraceArrivals(trace.requests)), timer)
    writer.close()
    mine = writer.record().requests[["request_id", *TIMES]]
    theirs = rec.requests[["request_id", "arrival", *TIMES]]
    both = theirs.merge(mine, on="request_id", how="outer", suffixes=("", "_replay"))
    return Replay(timer.i, timer.recorded, timer.divergence, both)
