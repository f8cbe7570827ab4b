"""Turns scheduler state and step times into run-record rows; the engine and the simulator both use it."""
from __future__ import annotations

from typing import Callable

import numpy as np

from servecap.costs.shapes import BACKENDS, DecodeShape, backend_named, kv_read
from servecap.traces.records import RunWriter, StepRow
from servecap.traces.workload import Request

from .scheduler import PrefillWork, Seq


_row = tuple.__new__  # a StepRow from its fields in order, without the named tuple's keyword-taking __new__


class Recorder:
    """`tokens`: keep every token's time (and id); `decode_steps`: keep a row per decode step (the simulator's
    summary runs keep only requests and prefill steps, which is all the metrics need)."""

    def __init__(self, writer: RunWriter, backend: str, tokens: bool = True, decode_steps: bool = True,
                 replica: int = 0):
        backend = backend_named(backend)
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
        self.writer = writer
        self._add_step, self._add_request = writer.adder("steps"), writer.adder("requests")
        self.backend = backend
        self.tokens = tokens
        self.keep_decode = decode_steps
        self.replica = replica

    def prefill(self, step: int, work: PrefillWork, n_admitted: int, n_preempted: int, start: float,
                end: float) -> None:
        """A prefill step, or a fused one (kind `mixed`: its decode rows' K/V in kv_tokens and kv_max)."""
        self._add_step(self.prefill_row(step, work, n_admitted, n_preempted, start, end))

    def prefill_row(self, step: int, work: PrefillWork, n_admitted: int, n_preempted: int, start: float,
                    end: float) -> StepRow:
        s, d = work.shape, work.decode
        if d:
            kv = s.prefix[:d]
            kv_tokens, kv_max, group = sum(kv) + d, max(kv) + 1, work.seqs[-1].group_id
        else:
            kv_tokens, kv_max, group = 0, 0, work.seqs[0].group_id
        return _row(StepRow, (step, work.kind, s.rows, work.padded_len, work.prompt_tokens, s.tokens, s.attn,
                              kv_tokens, kv_max, kv_tokens, start, end, group, n_admitted, 0, self.replica,
                              n_preempted, work.recomputed, d))

    def decode_steps(self, step: int, shape: DecodeShape, start: float, ends: list[float], retired: int,
                     n_preempted: int, next_start: float) -> None:
        """Consecutive decode steps of the same rows from `step` (the first has `shape`), the first starting at
        `start`, each ending where the next starts; the timer's `ends`, but the last step ends where the next pass
        starts (`next_start`: it holds the rows' retirement). Rows retire only in the last. The simulator writes a
        whole stretch of decode steps at once. Called only when the recorder keeps decode steps (keep_decode)."""
        n = len(ends)
        starts, ends = [start, *ends[:-1]], [*ends[:-1], next_start]
        j = np.arange(n)
        rows = shape.rows
        kv_tokens, kv_max = shape.kv_tokens + rows * j, shape.kv_max + j
        columns = zip(range(step, step + n), ["decode"] * n, [rows] * n, [0] * n, [0] * n, [0] * n, [0] * n,
                      kv_tokens.tolist(), kv_max.tolist(), kv_read(self.backend, rows, kv_tokens, kv_max).tolist(),
                      np.asarray(starts, float).tolist(), np.asarray(ends, float).tolist(), [-1] * n, [0] * n,
                      [0] * (n - 1) + [retired], [self.replica] * n, [n_preempted] + [0] * (n - 1), [0] * n,
                      [0] * n)
        self.writer.add_many("steps", map(StepRow._make, columns))

    def finish(self, seqs: list[Seq]) -> None:
        for s in seqs:
            r = s.req
            self._add_request((r.request_id, r.arrival, s.admitted, s.admit_step, s.group_id, s.group_size,
                               s.first_token, s.finished, r.prompt_tokens, s.generated, len(s.block_table),
                               self.replica, s.preemptions, s.recomputed, s.cached))
            if self.tokens and s.token_times:
                ids = s.token_ids or [-1] * len(s.token_times)
                self.writer.add_many("tokens", ((r.request_id, i, t, tok) for i, (t, tok) in enumerate(zip(s.token_times, ids))))

    def reject(self, req: Request, reason: str) -> None:
        self.writer.add("rejected", (req.request_id, req.arrival, reason))

    def flush(self) -> None:
        pass  # every row is written when it is made (WriteBehind holds them)


class WriteBehind:
    """A run log that holds each row-writing call until flush(), which makes them in order.

    Writing a pass's rows (a stretch's decode steps, every token of the requests it retired) is host work of a few
    hundred microseconds. Made where the step loop calls it, it runs while the device is idle, before the next pass's
    first launch, so serving's pass starts pay for it and closed runs' long stretches do not. The engine's timer
    flushes once the next pass's first step is launched instead (servecap/engine/serve.py): the rows and their order
    are the same, written one step later. Side by side on an H200 this hid the writes behind a decode stretch's
    launches but not behind a prefill step's (results/calibration/t10/check, the README's validation v11). What a call writes is final when it is made: the step loop hands over ended steps
    and retired sequences, which nothing changes afterwards, and a prefill step's row is made at once (a sequence it
    admitted may be preempted, and admitted again in another group, before the next flush)."""

    def __init__(self, log: Recorder):
        self.log = log
        self.backend, self.tokens, self.keep_decode = log.backend, log.tokens, log.keep_decode
        self._pending: list[tuple[Callable[..., None], tuple]] = []

    def prefill(self, *args) -> None:
        self._pending.append((self.log.writer.add, ("steps", self.log.prefill_row(*args))))

    def decode_steps(self, *args) -> None:
        self._pending.append((self.log.decode_steps, args))

    def finish(self, seqs: list[Seq]) -> None:
        self._pending.append((self.log.finish, (seqs,)))

    def reject(self, req: Request, reason: str) -> None:
        self._pending.append((self.log.reject, (req, reason)))

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        for write, args in pending:
            write(*args)
