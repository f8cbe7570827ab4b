"""Turns scheduler state and step times into run-record rows; the engine and the simulator both use it."""
from __future__ import annotations

import numpy as np

from traces.records import RunWriter
from traces.workload import Request

from .scheduler import Seq

BACKENDS = ("paged", "padded")


def kv_read(backend: str, rows: int, kv_tokens: int, kv_max: int) -> int:
    """K/V tokens a decode step's attention reads: true lengths (paged) or every row at the widest (padded)."""
    return kv_tokens if backend == "paged" else rows * kv_max


class Recorder:
    def __init__(self, writer: RunWriter, backend: str, tokens: bool = True):
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
        self.writer = writer
        self.backend = backend
        self.tokens = tokens

    def prefill(self, step: int, group: list[Seq], start: float, end: float) -> None:
        real = sum(s.req.prompt_tokens for s in group)
        padded = max(s.req.prompt_tokens for s in group)
        self.writer.add("steps", (step, "prefill", len(group), padded, real, 0, 0, 0, start, end,
                                  group[0].group_id, len(group), 0))

    def decode(self, step: int, rows: int, kv_tokens: int, kv_max: int, start: float, retired: int, *, end: float) -> None:
        self.decode_steps(step, rows, [kv_tokens], [kv_max], [start], [end], retired)

    def decode_steps(self, step: int, rows: int, kv_tokens, kv_max, starts, ends, retired: int) -> None:
        """Consecutive decode steps of the same rows from `step`, one array entry each; rows retire only in the last.

        The simulator writes a whole stretch of decode steps at once through this.
        """
        n = len(ends)
        kv_tokens, kv_max = np.asarray(kv_tokens), np.asarray(kv_max)
        self.writer.add_many("steps", zip(range(step, step + n), ["decode"] * n, [rows] * n, [0] * n, [0] * n,
                                          kv_tokens.tolist(), kv_max.tolist(),
                                          kv_read(self.backend, rows, kv_tokens, kv_max).tolist(),
                                          np.asarray(starts, float).tolist(), np.asarray(ends, float).tolist(),
                                          [-1] * n, [0] * n, [0] * (n - 1) + [retired]))

    def finish(self, seqs: list[Seq]) -> None:
        for s in seqs:
            r = s.req
            self.writer.add("requests", (r.request_id, r.arrival, s.admitted, s.admit_step, s.group_id, s.group_size,
                                         s.first_token, s.finished, r.prompt_tokens, s.generated, s.blocks_needed))
            if self.tokens and s.token_times:
                ids = s.token_ids or [-1] * len(s.token_times)
                self.writer.add_many("tokens", ((r.request_id, i, t, tok) for i, (t, tok) in enumerate(zip(s.token_times, ids))))

    def reject(self, req: Request, reason: str) -> None:
        self.writer.add("rejected", (req.request_id, req.arrival, reason))
