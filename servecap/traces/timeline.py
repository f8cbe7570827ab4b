"""Run records as Chrome trace-event JSON, the format ui.perfetto.dev and chrome://tracing open. Several records
(a real run and a simulated one of the same trace) go in one file, one process each, on their own time axes; a
fleet's record gives one process per replica (each has its own rows, pool and queue).

In each process:
    track "steps"  one complete event ("X") per prefill step, and one per stretch of consecutive decode steps of
                   the same row count (args: steps, the count; first and last step; step time mean, min and max;
                   K/V tokens at the first and last step; rows retired at its end). A run of a few hundred
                   requests has thousands of decode steps but a few hundred stretches, which keeps the file small
                   and the view readable; every_step=True writes one event per decode step instead.
    track "row k"  which request holds batch row k, from admission to finish. Requests take the lowest free row
                   in order of admission; a row freed at a time can be taken at that same time.
    counters       "queue depth" (requests arrived and not admitted) and "free KV blocks" (the pool's blocks,
                   meta pool_blocks, less those held by running requests), at every change.
Timestamps and durations are whole microseconds of the record's own clock (the format's unit), each an instant
rounded on its own and a duration the difference of its rounded ends: an event that ends when the next begins
ends at the next one's timestamp exactly. Fractional microseconds would not: readers turn them into whole
nanoseconds by truncation, which can put an event's end 1 ns past the next one's start.
"""
from __future__ import annotations

import heapq
import json
from pathlib import Path

import numpy as np
import pandas as pd

from .csvio import atomic_write_text
from .errors import InputError
from .metrics import replica_records
from .records import RunRecord

STEPS_TID = 0  # row k's track is tid k + 1


def _us(t) -> int:
    return round(float(t) * 1e6)


def _meta(pid: int, tid: int, name: str, value) -> dict:
    key = "name" if name.endswith("_name") else "sort_index"
    return {"name": name, "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": {key: value}}


def step_events(steps: pd.DataFrame, pid: int, every_step: bool = False) -> list[dict]:
    """The steps track: prefill steps, and decode steps collapsed into stretches of the same row count."""
    s = steps.sort_values(["start", "step"], kind="stable").reset_index(drop=True)
    if s.empty:
        return []
    decode = (s["kind"] == "decode").to_numpy()
    rows = s["rows"].to_numpy()
    new = np.ones(len(s), bool)
    if not every_step:
        new[1:] = ~(decode[1:] & decode[:-1] & (rows[1:] == rows[:-1]))
    first = np.flatnonzero(new)
    last = np.append(first[1:], len(s)) - 1
    ms = (s["end"] - s["start"]).to_numpy(float) * 1e3
    count = last - first + 1
    mean, lo, hi = np.add.reduceat(ms, first) / count, np.minimum.reduceat(ms, first), np.maximum.reduceat(ms, first)
    retired = np.add.reduceat(s["retired"].to_numpy(), first)
    col = {c: s[c].to_numpy() for c in ("step", "rows", "padded_len", "prompt_tokens", "tokens", "attn", "group_id",
                                        "n_admitted", "kv_tokens", "kv_max")}
    start, end = s["start"].to_numpy(float), s["end"].to_numpy(float)
    events = []
    for k, (i, j) in enumerate(zip(first, last)):
        if decode[i]:
            args = {"steps": int(count[k]), "first_step": int(col["step"][i]), "last_step": int(col["step"][j]),
                    "rows": int(rows[i]), "step_ms_mean": round(float(mean[k]), 4),
                    "step_ms_min": round(float(lo[k]), 4), "step_ms_max": round(float(hi[k]), 4),
                    "kv_tokens": int(col["kv_tokens"][i]), "kv_tokens_last": int(col["kv_tokens"][j]),
                    "kv_max_last": int(col["kv_max"][j]), "retired": int(retired[k])}
        else:
            args = {c: int(col[c][i]) for c in ("step", "rows", "padded_len", "prompt_tokens", "tokens", "attn",
                                                "group_id", "n_admitted")}
        ts = _us(start[i])
        events.append({"name": "decode" if decode[i] else "prefill", "ph": "X", "ts": ts,
                       "dur": _us(end[j]) - ts, "pid": pid, "tid": STEPS_TID, "args": args})
    return events


def row_slots(requests: pd.DataFrame) -> pd.Series:
    """Each admitted and finished request's batch row (index: the requests frame's), lowest free row first."""
    r = requests.dropna(subset=["admitted", "finished"]).sort_values(["admitted", "request_id"], kind="stable")
    busy: list[tuple[float, int]] = []  # (finished, slot) of the rows held
    free: list[int] = []
    slots, used = {}, 0
    for idx, admitted, finished in zip(r.index, r["admitted"].to_numpy(float), r["finished"].to_numpy(float)):
        while busy and busy[0][0] <= admitted:
            heapq.heappush(free, heapq.heappop(busy)[1])
        if free:
            slot = heapq.heappop(free)
        else:
            slot, used = used, used + 1
        slots[idx] = slot
        heapq.heappush(busy, (finished, slot))
    return pd.Series(slots, dtype=int)


def row_events(requests: pd.DataFrame, pid: int) -> list[dict]:
    slots = row_slots(requests)
    r = requests.loc[slots.index]
    events = []
    for q, slot in zip(r.itertuples(index=False), slots.to_numpy()):
        ts = _us(q.admitted)
        events.append({"name": f"request {q.request_id}", "ph": "X", "ts": ts, "dur": _us(q.finished) - ts,
                       "pid": pid, "tid": STEPS_TID + 1 + int(slot),
                       "args": {"request_id": int(q.request_id), "arrival_s": float(q.arrival),
                                "queue_wait_ms": round((q.admitted - q.arrival) * 1e3, 4),
                                "ttft_ms": round((q.first_token - q.arrival) * 1e3, 4),
                                "prompt_tokens": int(q.prompt_tokens), "output_tokens": int(q.output_tokens),
                                "group_id": int(q.group_id), "blocks": int(q.blocks)}})
    return events


def _level(up: np.ndarray, down: np.ndarray, up_w: np.ndarray | None = None, down_w: np.ndarray | None = None,
           since: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A count that rises at `up` and falls at `down` (by the weights, else 1): each change time (and `since`) and
    the level from it on."""
    up_w = np.ones(len(up)) if up_w is None else up_w
    down_w = np.ones(len(down)) if down_w is None else down_w
    t = np.unique(np.concatenate((up, down, [] if since is None else [since])))
    o_up, o_down = np.argsort(up, kind="stable"), np.argsort(down, kind="stable")
    rise = np.concatenate(([0.0], np.cumsum(up_w[o_up])))[np.searchsorted(up[o_up], t, side="right")]
    fall = np.concatenate(([0.0], np.cumsum(down_w[o_down])))[np.searchsorted(down[o_down], t, side="right")]
    return t, rise - fall


def counter_events(rec: RunRecord, pid: int) -> list[dict]:
    r = rec.requests
    arrival = r["arrival"].to_numpy(float)
    admitted = r["admitted"].dropna().to_numpy(float)
    t, depth = _level(arrival, admitted)
    events = [{"name": "queue depth", "ph": "C", "ts": _us(x), "pid": pid, "tid": STEPS_TID,
               "args": {"requests": int(v)}} for x, v in zip(t, depth)]
    pool = rec.meta.get("pool_blocks")
    if pool is not None:
        held = r.dropna(subset=["admitted"])
        fin = held.dropna(subset=["finished"])
        # From the first arrival, so the pool shows whole before the first admission takes blocks.
        t, used = _level(held["admitted"].to_numpy(float), fin["finished"].to_numpy(float),
                         held["blocks"].to_numpy(float), fin["blocks"].to_numpy(float),
                         float(arrival.min()) if len(arrival) else None)
        events += [{"name": "free KV blocks", "ph": "C", "ts": _us(x), "pid": pid, "tid": STEPS_TID,
                    "args": {"blocks": int(pool - v)}} for x, v in zip(t, used)]
    return events


def record_events(rec: RunRecord, pid: int, name: str, every_step: bool = False) -> list[dict]:
    """One engine's process: its name, tracks and counters, in time order after the naming metadata."""
    body = step_events(rec.steps, pid, every_step) + row_events(rec.requests, pid) + counter_events(rec, pid)
    body.sort(key=lambda e: e["ts"])  # stable: a track's events keep their order at equal times
    rows = sorted({e["tid"] for e in body if e["tid"] != STEPS_TID})
    names = [_meta(pid, STEPS_TID, "process_name", name), _meta(pid, STEPS_TID, "process_sort_index", pid),
             _meta(pid, STEPS_TID, "thread_name", "steps"), _meta(pid, STEPS_TID, "thread_sort_index", STEPS_TID)]
    for tid in rows:
        names += [_meta(pid, tid, "thread_name", f"row {tid - STEPS_TID - 1}"),
                  _meta(pid, tid, "thread_sort_index", tid)]
    return names + body


def engines(rec: RunRecord, name: str) -> list[tuple[RunRecord, str]]:
    """The engines of a record with their process names: itself, or each replica of a fleet's."""
    if int(rec.meta.get("replicas", 1)) <= 1 and rec.requests["replica"].nunique() <= 1 \
            and rec.steps["replica"].nunique() <= 1:
        return [(rec, name)]
    return [(part, f"{name} replica {i}") for i, part in replica_records(rec).items()]


def default_names(records: list[RunRecord]) -> list[str]:
    """Each record's meta kind (engine, sim), numbered where two share one."""
    kinds = [str(r.meta.get("kind") or "record") for r in records]
    return [k if kinds.count(k) == 1 else f"{k} #{i + 1}" for i, k in enumerate(kinds)]


def timeline(records: list[RunRecord], names: list[str] | None = None, every_step: bool = False) -> dict:
    """The trace-event document of `records`, one process per engine (pid 1, 2, ...): a fleet's record gives one
    per replica."""
    names = names or default_names(records)
    if len(names) != len(records):
        raise InputError(f"{len(names)} process name(s) for {len(records)} record(s): give one name per record")
    processes = [engine for rec, name in zip(records, names) for engine in engines(rec, name)]
    events = [e for pid, (rec, name) in enumerate(processes, start=1)
              for e in record_events(rec, pid, name, every_step)]
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"source": "servecap run records", "decode": "steps" if every_step else "stretches"}}


def write_timeline(records: list[RunRecord], path: str | Path, names: list[str] | None = None,
                   every_step: bool = False) -> Path:
    path = Path(path)
    if path.is_dir():
        raise InputError("is a directory, not a file to write the timeline to", path=path)
    atomic_write_text(path, json.dumps(timeline(records, names, every_step), separators=(",", ":")))
    return path
