"""Serving metrics over run records: one module scores the engine's measured runs and the simulator's predicted ones.

Every function takes a RunRecord (traces.records) and returns numbers or frames; times are seconds from the
run's start. Served requests are the requests-table rows with a finish time. Refused requests (the rejected
table) were never load the engine could carry, so no figure counts them.

Per request
    queue wait = admitted - arrival;  TTFT = first_token - arrival;  sojourn = finished - arrival;
    TPOT = (finished - first_token) / (output_tokens - 1), NaN for single-token requests.
Served rate = requests served / (last finished - first arrival).

Stability at offered rate r. docs/DESIGN.md asks for the served rate within 3% of r and a queue wait not trending
upward. A 400-request Poisson sample offers a few percent more or less than r, and the last request's time in
system is a noticeable part of a short run, so both halves are refined:
    expected  = n / (last arrival - first arrival + median sojourn of the first 10% of requests by arrival),
                what the trace itself offered, allowing the last request a typical unloaded sojourn;
    served_ok = served rate >= 0.97 x expected (serving faster than offered is never instability);
    rise      = Theil-Sen slope of queue wait against arrival time x the arrival span: the wait's rise over
                the run; trending when rise > rise_tol_s (default 1 s);
    stable    = served_ok and not trending.
r itself is only reported. A figure that cannot be computed (an empty run; a rise needs two distinct arrivals)
is NaN and compares False, so an empty run is not stable.
Capacity bracket from (rate, stable) pairs: hi = the lowest unstable rate, lo = the highest stable rate below
hi; None where there is none.

Admission groups (the requests one pass admitted; one prefill step each, under padded and packed prefill):
size = rows; padding waste = (tokens - prompt_tokens) / prompt_tokens, padded positions per real prompt token
(tokens: the positions the step computed, padding included); queue depth at admission = requests arrived by the
group's admission and not admitted before it, the group included.
Inter-token gaps (tokens table): the gaps between a request's consecutive token times; its baseline = the
median of its gaps; a spike = a gap over 3x its request's baseline. A spike is lined up with the prefill step
that overlaps its gap most, when at least SPIKE_PREFILL_SHARE of that step lies inside the gap.
Retirement overhead of a decode step that retired rows = its duration - the median duration of the
RETIRE_NEIGHBOURS decode steps of the same row count that retired none nearest by start time, floored at zero:
a decode step's row ends where the next pass starts, so it holds the time spent retiring rows and writing their
records.
Running rows: a request holds a row from admission to finish.
Closed runs: wall time = last finished - first arrival; decode tokens/s = sum(output_tokens - 1) / the summed
durations of the decode steps.
Percentiles are numpy's linear ones over the finite values (p50 = median); an empty set gives NaN.

SLOs (servecap/traces/slo.py). A served request meets an SLO when its metric is within the limit; a single-token request
has no TPOT and meets any TPOT limit (vLLM's benchmark counts its TPOT as 0). attainment = the fraction of served
requests meeting the SLO; goodput = requests meeting every SLO / the span of served rate (last finished - first
arrival), so goodput / served rate = good_fraction, the fraction that met them all. A point meets its SLOs
(slo_ok) when
    goodput >= 0.99 x served rate (good_fraction >= 0.99: at most 1% of the served requests missed one),
    served_ok (above: the served rate kept up with the offered rate, so what was served is what was offered), and
    each SLO with a percentile has that percentile of its metric within the limit.
The goodput is held to the served rate, not to r, for the reason served_ok is refined: over one run's span the
served rate of a sample that kept up differs from r by a few percent, more than the 1% the objective allows.
SLO capacity is the bracket of the (rate, slo_ok) pairs, found as the stability bracket is.

Fleets (records with a `replica` column of more than one value). Served rate, stability and the latency figures
are the fleet's, over all its requests; occupancy is per replica (each has its own rows, pool and FIFO queue),
time-weighted over the replicas' spans; per_replica() gives each replica's own summary.
"""
from __future__ import annotations

import math
from typing import Iterable

import numpy as np
import pandas as pd

from .records import RunRecord
from .slo import SLO

SERVED_FRACTION = 0.97
GOODPUT_FRACTION = 0.99
RISE_TOL_S = 1.0
EARLY_FRACTION = 0.1
SPIKE_FACTOR = 3.0
SPIKE_PREFILL_SHARE = 0.5  # of a prefill step that must lie inside a gap for the spike to be put down to it
RETIRE_NEIGHBOURS = 8  # decode steps the retirement overhead's reference is the median of
# Theil-Sen is quadratic in its points; past this many requests it runs on an evenly spaced subsample by
# arrival, which estimates the same slope and keeps a 100k-request summary fast.
TREND_POINTS = 1000


def _pct(values, q: float) -> float:
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    return float(np.percentile(v, q)) if v.size else math.nan


def _ratio(num: float, den: float) -> float:
    return float(num / den) if den > 0 else math.nan


def _served(rec: RunRecord) -> pd.DataFrame:
    r = rec.requests
    # Only the columns the figures read: a million-request run's full table is ~100 MB a copy.
    r = r.loc[r["finished"].notna(), ["request_id", "arrival", "admitted", "first_token", "finished", "output_tokens"]]
    return r.sort_values("arrival", kind="stable")


def _wall_time(served: pd.DataFrame) -> float:
    return float(served["finished"].max() - served["arrival"].min())


def _meta_rate(rec: RunRecord) -> float | None:
    trace = rec.meta.get("trace")
    return trace.get("rate") if isinstance(trace, dict) else None


def request_metrics(rec: RunRecord) -> pd.DataFrame:
    """One row per served request in arrival order: request_id, arrival, queue_wait, ttft, tpot, sojourn."""
    return _request_metrics(_served(rec))


def _request_metrics(r: pd.DataFrame) -> pd.DataFrame:
    decode_tokens = (r["output_tokens"] - 1).where(r["output_tokens"] > 1)
    return pd.DataFrame({
        "request_id": r["request_id"].to_numpy(),
        "arrival": r["arrival"].to_numpy(float),
        "queue_wait": (r["admitted"] - r["arrival"]).to_numpy(float),
        "ttft": (r["first_token"] - r["arrival"]).to_numpy(float),
        "tpot": ((r["finished"] - r["first_token"]) / decode_tokens).to_numpy(float),
        "sojourn": (r["finished"] - r["arrival"]).to_numpy(float),
    })


def served_rate(rec: RunRecord) -> float:
    """Requests served / (last finished - first arrival); NaN for an empty run."""
    return _served_rate(_served(rec))


def _served_rate(served: pd.DataFrame) -> float:
    return _ratio(len(served), _wall_time(served))


def _trend_rise(arrival: np.ndarray, wait: np.ndarray) -> float:
    span = float(arrival[-1] - arrival[0]) if arrival.size else 0.0
    if span <= 0:
        return math.nan
    if arrival.size > TREND_POINTS:
        keep = np.linspace(0, arrival.size - 1, TREND_POINTS).round().astype(int)
        arrival, wait = arrival[keep], wait[keep]
    return float(theil_sen_slope(arrival, wait) * span)


def theil_sen_slope(x: np.ndarray, y: np.ndarray) -> float:
    """The median of the slopes between every pair of points with distinct x (scipy.stats.theilslopes' slope)."""
    dx = x[:, None] - x
    pos = dx > 0
    slopes = (y[:, None] - y).astype(float, copy=False)
    np.divide(slopes, dx, out=slopes, where=pos)  # in place, then one selection (not two) of the pairs kept
    return float(np.median(slopes[pos])) if pos.any() else math.nan


def stability(rec: RunRecord, rate: float | None = None, rise_tol_s: float = RISE_TOL_S) -> dict:
    """Whether the run kept up with its load, with every piece of the verdict (see the module docstring).

    Keys: rate (r, from meta['trace']['rate'] when not given; only reported), served_rate, expected_rate,
    trend_rise_s, served_ok, trending, stable.
    """
    served = _served(rec)
    return _stability(_request_metrics(served), _served_rate(served), rate if rate is not None else _meta_rate(rec),
                      rise_tol_s)


def _stability(m: pd.DataFrame, served: float, rate: float | None, rise_tol_s: float) -> dict:
    """stability() from the run's request_metrics and served rate."""
    early = m["sojourn"].iloc[:max(1, math.ceil(EARLY_FRACTION * len(m)))]
    expected = _ratio(len(m), float(m["arrival"].max() - m["arrival"].min() + early.median()))
    rise = _trend_rise(m["arrival"].to_numpy(), m["queue_wait"].to_numpy())
    served_ok = served >= SERVED_FRACTION * expected
    trending = rise > rise_tol_s
    return {"rate": rate, "served_rate": served, "expected_rate": expected,
            "trend_rise_s": rise, "served_ok": bool(served_ok), "trending": bool(trending),
            "stable": bool(served_ok and not trending)}


def stability_said(s: dict) -> str:
    """A summary's stability verdict in words, with both of its rules and how far the run was from each."""
    rise_ms = s["trend_rise_s"] * 1e3
    trend = (f"{'rose' if rise_ms >= 0 else 'fell'} {abs(rise_ms):,.1f} ms" if abs(rise_ms) >= 0.05 else
             "did not rise") + " over the run" + \
        f", past the {RISE_TOL_S * 1e3:,.0f} ms allowed" * (s["trend_rise_s"] > RISE_TOL_S)
    served = f"served {s['served_rate'] / s['expected_rate']:.1%} of the offered rate" + \
        f", under the {SERVED_FRACTION:.0%} needed" * (not s["served_ok"])
    return f"{'stable' if s['stable'] else 'NOT stable'} ({served}; queue wait {trend})"


def capacity_bracket(points: Iterable[tuple[float, bool]]) -> tuple[float | None, float | None]:
    """(lo, hi) from (rate, stable) pairs in any order: hi = lowest unstable rate, lo = highest stable rate below it."""
    points = [(float(r), bool(s)) for r, s in points]
    unstable = [r for r, s in points if not s]
    hi = min(unstable) if unstable else None
    # A stable rate above the first unstable one is noise in the sample, not capacity.
    below = [r for r, s in points if s and (hi is None or r < hi)]
    return (max(below) if below else None), hi


def queue_depth(rec: RunRecord, t) -> np.ndarray:
    """Requests arrived by each time in `t` and not admitted before it: the queue an admission at that time drew
    from, the admitted group included."""
    r = rec.requests
    t = np.asarray(t, float)
    arrived = np.searchsorted(np.sort(r["arrival"].to_numpy(float)), t, side="right")
    admitted_before = np.searchsorted(np.sort(r["admitted"].dropna().to_numpy(float)), t, side="left")
    return arrived - admitted_before


def admission_groups(rec: RunRecord) -> dict:
    """Group size p50/p95/max and padding waste p50/p95, plus 'groups': one row per prefill step (a chunk, under
    chunked prefill) with its size, positions, waste, duration, the part of it spent on padding (padding_s: the
    duration split by positions) and the queue depth when its group was admitted (NaN for a group whose requests
    the record lacks)."""
    p = _prefill_steps(rec)
    size, computed, real, waste = _group_sizes(p)
    duration = (p["end"] - p["start"]).to_numpy(float)
    admitted = rec.requests.groupby("group_id")["admitted"].min().reindex(p["group_id"]).to_numpy(float)
    known = np.isfinite(admitted)
    depth = np.full(len(p), math.nan)
    depth[known] = queue_depth(rec, admitted[known])
    groups = pd.DataFrame({"group_id": p["group_id"].to_numpy(), "step": p["step"].to_numpy(),
                           "start": p["start"].to_numpy(float), "end": p["end"].to_numpy(float),
                           "size": p["rows"].to_numpy(), "padded_len": p["padded_len"].to_numpy(),
                           "prompt_tokens": p["prompt_tokens"].to_numpy(), "padded_tokens": computed,
                           "waste": waste, "duration": duration,
                           "padding_s": duration * np.divide(computed - real, computed, out=np.zeros_like(real),
                                                             where=computed > 0),
                           "depth": depth})
    return {**_group_figures(size, waste), "groups": groups}


def _prefill_steps(rec: RunRecord, columns: list[str] | None = None) -> pd.DataFrame:
    """The prefill steps, with only `columns` when given (a copy of a million-step table is ~100 MB)."""
    return rec.steps.loc[rec.steps["kind"] == "prefill", columns or slice(None)]


def _group_sizes(p: pd.DataFrame) -> tuple[np.ndarray, ...]:
    """Each prefill step's rows, positions computed, real prompt tokens and padding waste."""
    computed, real = p["tokens"].to_numpy(float), p["prompt_tokens"].to_numpy(float)
    return p["rows"].to_numpy(float), computed, real, (computed - real) / real


def _group_figures(size: np.ndarray, waste: np.ndarray) -> dict:
    return {"group_size_p50": _pct(size, 50), "group_size_p95": _pct(size, 95), "group_size_max": _pct(size, 100),
            "padding_waste_p50": _pct(waste, 50), "padding_waste_p95": _pct(waste, 95)}


def groups_at_admission(rec: RunRecord) -> pd.DataFrame:
    """One row per admission group (the requests one pass admitted), whatever the prefill policy: group_id,
    admitted, size, prompt_tokens (of its requests in the record), padding (positions its prefill steps computed
    beyond real prompt tokens), waste = padding / prompt_tokens, padding_s (the padding's share of those steps'
    time, split by positions) and depth (queue depth at admission)."""
    r = rec.requests.dropna(subset=["admitted"])
    g = r.groupby("group_id").agg(admitted=("admitted", "min"), size=("group_size", "first"),
                                  prompt_tokens=("prompt_tokens", "sum"))
    steps = admission_groups(rec)["groups"]
    pad = (steps["padded_tokens"] - steps["prompt_tokens"]).groupby(steps["group_id"]).sum()
    g["padding"] = pad.reindex(g.index, fill_value=0).to_numpy(float)
    g["waste"] = g["padding"] / g["prompt_tokens"]
    g["padding_s"] = steps.groupby("group_id")["padding_s"].sum().reindex(g.index, fill_value=0.0)
    g["depth"] = queue_depth(rec, g["admitted"].to_numpy(float))
    return g.reset_index()


def groups_by_depth(groups: pd.DataFrame) -> pd.DataFrame:
    """groups_at_admission's (or admission_groups') groups binned by queue depth at admission, each bin from a
    power of two (depth_lo) to just below the next (depth_hi): groups, size_mean, size_p50, size_max, waste_p50,
    waste_p95 and padding_s (summed)."""
    g = groups[groups["depth"] >= 1]
    lo = 2.0 ** np.floor(np.log2(g["depth"].to_numpy(float)))
    rows = []
    for b, part in g.groupby(lo, sort=True):
        rows.append({"depth_lo": int(b), "depth_hi": int(2 * b - 1), "groups": len(part),
                     "size_mean": float(part["size"].mean()), "size_p50": _pct(part["size"], 50),
                     "size_max": _pct(part["size"], 100), "waste_p50": _pct(part["waste"], 50),
                     "waste_p95": _pct(part["waste"], 95), "padding_s": float(part["padding_s"].sum())})
    return pd.DataFrame(rows, columns=["depth_lo", "depth_hi", "groups", "size_mean", "size_p50", "size_max",
                                       "waste_p50", "waste_p95", "padding_s"])


def token_gaps(rec: RunRecord) -> dict:
    """Inter-token gaps: baseline_p50 (median of per-request baselines), gap_max (the largest gap between any
    request's consecutive tokens), n_spikes, spike_gap_p50, spike_gap_max, 'gaps' (request_id, index, gap, time of
    the token that ended the gap) and 'spikes' (the same with the request's baseline) to line up with prefills.
    """
    rid, index = rec.tokens["request_id"].to_numpy(), rec.tokens["index"].to_numpy()
    # One integer key sorts (request, index) some 20x faster than a two-column sort at 16M tokens.
    order = np.argsort(rid * (index.max(initial=0) + 1) + index, kind="stable")
    rid, index, time = rid[order], index[order], rec.tokens["time"].to_numpy(float)[order]
    same = rid[1:] == rid[:-1]
    gap = np.diff(time)[same]
    rid, index, time = rid[1:][same], index[1:][same], time[1:][same]  # each gap's closing token
    codes, _ = pd.factorize(rid)  # rid is sorted, so codes follow the groupby's order
    per_request = pd.Series(gap).groupby(codes).median().to_numpy()
    baseline = per_request[codes]
    spike = gap > SPIKE_FACTOR * baseline
    gaps = pd.DataFrame({"request_id": rid, "index": index, "gap": gap, "time": time})
    spikes = pd.DataFrame({"request_id": rid[spike], "index": index[spike], "gap": gap[spike],
                           "baseline": baseline[spike], "time": time[spike]})
    return {"baseline_p50": _pct(per_request, 50), "gap_max": _pct(gap, 100), "n_spikes": int(spike.sum()),
            "spike_gap_p50": _pct(spikes["gap"], 50), "spike_gap_max": _pct(spikes["gap"], 100), "gaps": gaps,
            "spikes": spikes}


def prefill_spikes(rec: RunRecord, spikes: pd.DataFrame | None = None) -> pd.DataFrame:
    """token_gaps' spikes (or `spikes`), each with the prefill step that ran inside its gap: 'prefill' is that
    step's index in rec.steps (-1 where none did), with its rows, padded_len, duration, start and padded_tokens
    (positions computed; NaN where none)."""
    spikes = (token_gaps(rec)["spikes"] if spikes is None else spikes).copy()
    pre = rec.steps[rec.steps["kind"] == "prefill"].assign(duration=lambda d: d["end"] - d["start"],
                                                             padded_tokens=lambda d: d["tokens"])
    spikes["prefill"] = -1
    if len(pre) and len(spikes):
        t, gap = spikes["time"].to_numpy(float)[:, None], spikes["gap"].to_numpy(float)[:, None]
        start, end = pre["start"].to_numpy(float)[None, :], pre["end"].to_numpy(float)[None, :]
        overlap = np.minimum(end, t) - np.maximum(start, t - gap)
        best = overlap.argmax(axis=1)
        ok = overlap[np.arange(len(spikes)), best] > SPIKE_PREFILL_SHARE * (end - start)[0, best]
        spikes["prefill"] = np.where(ok, pre.index.to_numpy()[best], -1)
    return spikes.join(pre[["rows", "padded_len", "duration", "start", "padded_tokens"]], on="prefill")


def retire_overhead(rec: RunRecord, neighbours: int = RETIRE_NEIGHBOURS) -> pd.DataFrame:
    """One row per decode step that retired rows (index: its index in rec.steps): retired, duration, reference
    (the median duration of the `neighbours` decode steps of the same row count that retired none, nearest by
    start time; NaN where the run has none) and overhead = duration - reference, floored at zero (zero without
    a reference)."""
    d = rec.steps[rec.steps["kind"] == "decode"]
    out = pd.DataFrame({"retired": d["retired"].to_numpy(), "duration": (d["end"] - d["start"]).to_numpy(float)},
                       index=d.index)
    out = out[d["retired"].to_numpy() > 0].assign(reference=math.nan)
    for _, same in d.groupby("rows"):
        ref = same[same["retired"] == 0].sort_values("start", kind="stable")
        ret = same[same["retired"] > 0]
        if ret.empty or ref.empty:
            continue
        ref_start, ref_dur = ref["start"].to_numpy(float), (ref["end"] - ref["start"]).to_numpy(float)
        t = ret["start"].to_numpy(float)
        # The nearest `neighbours` in start order lie within that many places either side of t's insertion point;
        # earlier candidates come first, so a tie in distance goes to the earlier step.
        idx = np.searchsorted(ref_start, t)[:, None] + np.arange(-neighbours, neighbours)[None, :]
        valid = (idx >= 0) & (idx < len(ref_start))
        idx = np.clip(idx, 0, len(ref_start) - 1)
        dist = np.where(valid, np.abs(ref_start[idx] - t[:, None]), np.inf)
        pick = np.argsort(dist, axis=1, kind="stable")[:, :neighbours]
        near = np.take_along_axis(np.where(valid, ref_dur[idx], np.nan), pick, axis=1)
        out.loc[ret.index, "reference"] = np.nanmedian(near, axis=1)
    out["overhead"] = (out["duration"] - out["reference"]).clip(lower=0).fillna(0.0)
    return out


def closed_run(rec: RunRecord) -> dict:
    """wall_time_s, decode_tok_s and ttft_p50 of a closed (all arrive at once) run."""
    return _closed_run(rec, _served(rec))


def _closed_run(rec: RunRecord, served: pd.DataFrame) -> dict:
    d = rec.steps.loc[rec.steps["kind"] == "decode", ["start", "end"]]
    return {"wall_time_s": _wall_time(served),
            "decode_tok_s": _ratio(float((served["output_tokens"] - 1).sum()), float((d["end"] - d["start"]).sum())),
            "ttft_p50": _pct(served["first_token"] - served["arrival"], 50)}


def running_rows(rec: RunRecord) -> pd.DataFrame:
    """The rows held over the run (first arrival to last finish) as segments of constant count: start, end, rows."""
    served = _served(rec)
    if served.empty:
        return pd.DataFrame({"start": [], "end": [], "rows": []})
    t0, t1 = float(served["arrival"].min()), float(served["finished"].max())
    admitted = np.sort(rec.requests["admitted"].dropna().to_numpy(float))
    finished = np.sort(rec.requests["finished"].dropna().to_numpy(float))
    t = np.unique(np.concatenate(([t0, t1], admitted, finished)))
    t = t[(t >= t0) & (t <= t1)]
    held = np.searchsorted(admitted, t[:-1], side="right") - np.searchsorted(finished, t[:-1], side="right")
    return pd.DataFrame({"start": t[:-1], "end": t[1:], "rows": held})


def occupancy(rec: RunRecord) -> dict:
    """How full the batch was and what held the queue back, over the run (first arrival to last finish).

    A request holds a row and its blocks from admission to finish and queues from arrival to admission;
    the queue head is the earliest arrival not yet admitted (admission is FIFO). Keys:
    mean_running_rows  running rows averaged over the run;
    rows_while_queued  running rows averaged over the time some request was queued (NaN if none was);
    head_blocked_frac  of the time any row was running, the fraction in which the queue head needed more
                       blocks than were free while a batch row was free: the pool, not the batch, held it back.
    A fleet's figures are per replica: each replica's integrals over its own span, summed over the replicas.
    """
    pool, max_batch = rec.meta.get("pool_blocks"), rec.meta.get("max_batch")
    nan = {"mean_running_rows": math.nan, "rows_while_queued": math.nan, "head_blocked_frac": math.nan}
    if pool is None or max_batch is None:
        return nan
    replica = rec.requests["replica"].to_numpy()
    engines = [rec.requests] if replica.size and (replica == replica[0]).all() else \
        [r for _, r in rec.requests.groupby("replica", sort=True)]  # a groupby costs a 400-request point ~1 ms
    parts = [p for r in engines if (p := _occupancy_integrals(r, pool, max_batch)) is not None]
    if not parts:
        return nan
    sums = [sum(p[k] for p in parts) for k in range(6)]  # the sum of one term is that term, bit for bit
    return {"mean_running_rows": _ratio(sums[0], sums[1]), "rows_while_queued": _ratio(sums[2], sums[3]),
            "head_blocked_frac": _ratio(sums[4], sums[5])}


def _occupancy_integrals(requests: pd.DataFrame, pool: int, max_batch: int) -> tuple[float, ...] | None:
    """One engine's (running x dt, dt, running x dt while queued, dt while queued, dt blocked, dt running) sums."""
    r = requests[["arrival", "request_id", "admitted", "finished", "blocks"]].sort_values(["arrival", "request_id"],
                                                                                        kind="stable")
    n = len(r)
    if n == 0:
        return None
    arrival = r["arrival"].to_numpy(float)
    admitted = np.nan_to_num(r["admitted"].to_numpy(float), nan=math.inf)  # never admitted: queued to the end
    finished = np.nan_to_num(r["finished"].to_numpy(float), nan=math.inf)  # never finished: running to the end
    blocks = r["blocks"].to_numpy(float)
    t = np.unique(np.concatenate((arrival, admitted, finished)))
    end = finished[np.isfinite(finished)].max(initial=arrival.max())
    t = t[(t >= arrival.min()) & (t <= end)]
    if t.size < 2:
        return None
    dt, t = np.diff(t), t[:-1]  # the state is constant on each [t, t + dt)
    # Arrays as long as t (3 per request) are dropped as soon as they are used: a million-request run's are ~24 MB
    # each, and this is where its summary peaks.
    admitted_by = np.searchsorted(admitted, t, side="right")  # FIFO: the first k in arrival order
    head = np.minimum(admitted_by, n - 1)
    queued = (admitted_by < n) & (arrival[head] <= t)
    fin_order = np.argsort(finished, kind="stable")
    finished_by = np.searchsorted(finished[fin_order], t, side="right")
    del t
    running = admitted_by - finished_by
    free = pool - (np.concatenate(([0.0], np.cumsum(blocks)))[admitted_by] -
                   np.concatenate(([0.0], np.cumsum(blocks[fin_order])))[finished_by])
    del admitted_by, finished_by
    blocked = queued & (running < max_batch) & (blocks[head] > free)
    del head, free
    busy = dt * (running > 0)
    while_queued = dt * queued
    return (float((running * dt).sum()), float(dt.sum()), float((running * while_queued).sum()),
            float(while_queued.sum()), float((blocked * busy).sum()), float(busy.sum()))


def slo_scores(rec: RunRecord, slos: tuple[SLO, ...]) -> dict:
    """goodput, and per SLO attain_<metric> (the fraction of served requests within its limit) and, for an SLO
    with a percentile, that percentile as <metric>_p<NN>; tails_ok: every such percentile within its limit."""
    served = _served(rec)
    return _slo_scores(_request_metrics(served), served, slos)


def _slo_scores(m: pd.DataFrame, served: pd.DataFrame, slos: tuple[SLO, ...]) -> dict:
    """slo_scores() from the run's served requests and their request_metrics."""
    good = np.ones(len(m), dtype=bool)
    out: dict = {}
    tails_ok = True
    for slo in slos:
        values = m[slo.column].to_numpy(float)
        ok = ~(values > slo.limit_s)  # NaN (a single-token request's TPOT) is not over any limit
        good &= ok
        out[f"attain_{slo.metric}"] = _ratio(float(ok.sum()), len(m))
        if slo.percentile is not None:
            tail = _pct(values, slo.percentile)  # over the requests that have the metric
            out[slo.name] = tail
            tails_ok = tails_ok and bool(tail <= slo.limit_s)  # NaN (no requests) is not within it
    out["goodput"] = _ratio(float(good.sum()), _wall_time(served)) if len(served) else math.nan
    out["good_fraction"] = _ratio(float(good.sum()), len(m))
    out["tails_ok"] = tails_ok
    return out


def slo_keys(slos: tuple[SLO, ...]) -> list[str]:
    """The keys summary() adds for these SLOs, in a stable order (sweep.csv's extra columns)."""
    keys = ["goodput", "good_fraction", "slo_ok"]
    for slo in slos:
        keys.append(f"attain_{slo.metric}")
        if slo.percentile is not None:
            keys.append(slo.name)
    return keys


def scored(rec: RunRecord, rate: float | None) -> dict:
    """How a run is scored against a prediction: summary(), and for a closed run (no rate) closed_run() too."""
    s = summary(rec, rate)
    if rate is None:
        s.update(closed_run(rec))
    return s


def summary(rec: RunRecord, rate: float | None = None, slos: tuple[SLO, ...] = ()) -> dict:
    """The headline figures every report uses, flat and JSON-friendly (NaN where a run has none).

    Keys: n, served_rate, queue_wait_p50/p95, ttft_p50/p95, tpot_p50, group_size_p50/p95/max,
    padding_waste_p50/p95, wall_time_s, decode_tok_s, mean_running_rows, rows_while_queued, head_blocked_frac;
    with a rate (given, or meta['trace']['rate']) also rate, stable, served_ok, trend_rise_s, expected_rate;
    with SLOs also slo_scores()'s keys (but tails_ok), and with both slo_ok (the module docstring).
    """
    served = _served(rec)  # once: every figure below starts from it
    m = _request_metrics(served)
    # admission_groups' figures, without its groups frame
    size, _, _, waste = _group_sizes(_prefill_steps(rec, ["rows", "tokens", "prompt_tokens"]))
    closed = _closed_run(rec, served)
    served_rate_ = _served_rate(served)
    out = {"n": len(m), "served_rate": served_rate_,
           "queue_wait_p50": _pct(m["queue_wait"], 50), "queue_wait_p95": _pct(m["queue_wait"], 95),
           "ttft_p50": _pct(m["ttft"], 50), "ttft_p95": _pct(m["ttft"], 95), "tpot_p50": _pct(m["tpot"], 50),
           **_group_figures(size, waste),
           "wall_time_s": closed["wall_time_s"], "decode_tok_s": closed["decode_tok_s"], **occupancy(rec)}
    if rec.meta.get("admission", "reserve") != "reserve" or rec.meta.get("prefix_cache"):
        out.update(memory_figures(rec, closed["wall_time_s"]))
    rate = rate if rate is not None else _meta_rate(rec)
    if rate is not None:
        s = _stability(m, served_rate_, rate, RISE_TOL_S)
        out.update(rate=float(rate), stable=s["stable"], served_ok=s["served_ok"], trend_rise_s=s["trend_rise_s"],
                   expected_rate=s["expected_rate"])
    if slos:
        scores = _slo_scores(m, served, slos)
        tails_ok = scores.pop("tails_ok")
        out.update(scores)
        if rate is not None:
            out["slo_ok"] = bool(scores["good_fraction"] >= GOODPUT_FRACTION and out["served_ok"] and tails_ok)
    return out


def memory_figures(rec: RunRecord, wall_time_s: float) -> dict:
    """What on-demand admission and prefix caching did (summary() adds them to runs with either): preemptions,
    the share of served requests preempted at least once, positions recomputed after a preemption and the share
    of the run's wall time their steps spent on them (each step's time by its share of positions), and the
    prefix cache's hit rate (cached prompt positions over all prompt positions of served requests)."""
    steps = rec.steps.loc[rec.steps["recomputed"] > 0, ["start", "end", "recomputed", "tokens"]]
    redo_s = float(((steps["end"] - steps["start"]) * steps["recomputed"] / steps["tokens"]).sum())
    r = rec.requests
    served = r.loc[r["finished"].notna(), ["prompt_tokens", "preemptions", "recomputed_tokens", "cached_tokens"]]
    prompt = float(served["prompt_tokens"].sum())
    return {"preemptions": int(served["preemptions"].sum()),
            "preempted_frac": _ratio(int((served["preemptions"] > 0).sum()), len(served)),
            "recomputed_tokens": int(served["recomputed_tokens"].sum()),
            "recompute_time_frac": _ratio(redo_s, wall_time_s),
            "prefix_hit_rate": _ratio(float(served["cached_tokens"].sum()), prompt)}


def replica_records(rec: RunRecord) -> dict[int, RunRecord]:
    """Each replica's part of a run record (an idle replica of meta['replicas'] gets an empty one)."""
    ids = set(range(int(rec.meta.get("replicas", 1)))) | set(rec.requests["replica"].astype(int))
    parts = {}
    for i in sorted(ids):
        requests = rec.requests[rec.requests["replica"] == i]
        tokens = rec.tokens[rec.tokens["request_id"].isin(requests["request_id"])]
        parts[i] = RunRecord(rec.meta, requests, rec.steps[rec.steps["replica"] == i], tokens, rec.rejected.iloc[:0])
    return parts


def per_replica(rec: RunRecord, rate: float | None = None, slos: tuple[SLO, ...] = ()) -> pd.DataFrame:
    """summary() of each replica's own requests and steps, a row per replica: `replica`, `share` (its fraction of
    the served requests), and with a rate its offered share of it as `rate`."""
    rate = rate if rate is not None else _meta_rate(rec)
    total = len(_served(rec))
    rows = []
    for i, part in replica_records(rec).items():
        share = _ratio(len(_served(part)), total)
        rows.append({"replica": i, "share": share,
                     **summary(part, None if rate is None else rate * share, slos)})
    return pd.DataFrame(rows)
