"""Scoring a run record: the shared metrics (traces.metrics) plus how the batch rows and the pool were used.

occupancy() reads only the requests table and the run's max_batch and pool_blocks, so it scores the
engine's measured runs as well as the simulator's. It belongs in traces/metrics.py and lives here until
it moves there.
"""
from __future__ import annotations

import math

import numpy as np

from traces import metrics
from traces.records import RunRecord


def _mean(values: np.ndarray, weights: np.ndarray) -> float:
    total = weights.sum()
    return float((values * weights).sum() / total) if total > 0 else math.nan


def occupancy(rec: RunRecord) -> dict:
    """How full the batch was and what held the queue back, over the run (first arrival to last finish).

    A request holds a row and its blocks from admission to finish and queues from arrival to admission;
    the queue head is the earliest arrival not yet admitted (admission is FIFO). Keys:
    mean_running_rows  running rows averaged over the run;
    rows_while_queued  running rows averaged over the time some request was queued (NaN if none was);
    head_blocked_frac  of the time any row was running, the fraction in which the queue head needed more
                       blocks than were free while a batch row was free: the pool, not the batch, held it back.
    """
    r = rec.requests.sort_values(["arrival", "request_id"], kind="stable")
    n = len(r)
    if n == 0:
        return {"mean_running_rows": math.nan, "rows_while_queued": math.nan, "head_blocked_frac": math.nan}
    arrival = r["arrival"].to_numpy(float)
    admitted = np.nan_to_num(r["admitted"].to_numpy(float), nan=math.inf)  # never admitted: queued to the end
    finished = np.nan_to_num(r["finished"].to_numpy(float), nan=math.inf)  # never finished: running to the end
    blocks = r["blocks"].to_numpy(float)
    t = np.unique(np.concatenate((arrival, admitted, finished)))
    end = finished[np.isfinite(finished)].max(initial=arrival.max())
    t = t[(t >= arrival.min()) & (t <= end)]
    if t.size < 2:
        return {"mean_running_rows": math.nan, "rows_while_queued": math.nan, "head_blocked_frac": math.nan}
    dt, t = np.diff(t), t[:-1]  # the state is constant on each [t, t + dt)
    admitted_by = np.searchsorted(admitted, t, side="right")  # FIFO: the first k in arrival order
    fin_order = np.argsort(finished, kind="stable")
    finished_by = np.searchsorted(finished[fin_order], t, side="right")
    running = admitted_by - finished_by
    used = np.concatenate(([0.0], np.cumsum(blocks)))[admitted_by] - \
        np.concatenate(([0.0], np.cumsum(blocks[fin_order])))[finished_by]
    head = np.minimum(admitted_by, n - 1)
    queued = (admitted_by < n) & (arrival[head] <= t)
    pool, max_batch = rec.meta["pool_blocks"], rec.meta["max_batch"]
    blocked = queued & (running < max_batch) & (blocks[head] > pool - used)
    return {"mean_running_rows": _mean(running, dt), "rows_while_queued": _mean(running, dt * queued),
            "head_blocked_frac": _mean(blocked, dt * (running > 0))}


def score(rec: RunRecord, rate: float | None = None) -> dict:
    """metrics.summary (with stability at `rate`) and occupancy, flat and JSON-friendly."""
    return {**metrics.summary(rec, rate), **occupancy(rec)}
