"""Where a run's time goes: its wall time (first arrival to last finish) split by what the engine was doing,
overall and in windows of time with their offered rate, beside its admission groups, head-of-line blocking and
running rows. Pure computation over a run record (real or simulated); servecap/traces/explain_report.py prints and draws it.

The split. Every instant of the wall time falls in exactly one part:
    decode   in a decode step, less the step's retirement overhead;
    prefill  in a prefill step, its share for real new prompt tokens: duration x prompt_tokens / tokens;
    padding  in a prefill step, its share for padding: duration x (tokens - prompt_tokens) / tokens. A step's
             time is split by positions computed; a prefill row starts at its pass's start, so the admission
             work of the pass is inside it and split the same way;
    retire   the retirement overhead of a decode step that retired rows (metrics.retire_overhead), placed at
             the end of the step, after its compute;
    untimed  in no step while some request holds a row: engine work between a pass with no decode step and
             the next pass;
    idle     in no step and no request holds a row.
Steps are clipped to the wall time (the last step's retirement runs past the last finish). Windows cut the wall
time into equal parts; a window's offered rate = the arrivals in it / its length.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from . import metrics
from .errors import InputError
from .records import RunRecord

PARTS = ("decode", "prefill", "padding", "retire", "untimed", "idle")
DEFAULT_WINDOWS = 4


@dataclass
class Explanation:
    meta: dict
    start: float  # first arrival
    end: float  # last finish
    split: dict[str, float]  # seconds of the wall time in each part
    windows: pd.DataFrame  # start, end, arrivals, offered_rate, rows_mean, then seconds in each part
    rows: pd.Series  # share of the wall time with each number of rows running (index: rows)
    groups: pd.DataFrame  # metrics.groups_by_depth
    figures: dict  # the headline numbers, flat: what tables print and comparisons subtract
    notes: list[str] = field(default_factory=list)  # what qualifies the numbers of this record

    @property
    def wall(self) -> float:
        return self.end - self.start


def explain(rec: RunRecord, windows: int = DEFAULT_WINDOWS) -> Explanation:
    """Split `rec`'s wall time (see the module docstring) and gather what explains it."""
    if windows < 1:
        raise InputError(f"the number of windows must be at least 1, got {windows}")
    if rec.requests["replica"].nunique() > 1 or rec.steps["replica"].nunique() > 1:
        raise InputError("the record holds several replicas; explain reads one engine's record")
    served = rec.requests[rec.requests["finished"].notna()]
    if served.empty:
        raise InputError("the record has no finished request, so no wall time to explain")
    if rec.steps.empty:  # else every second a row is held would read as untimed
        raise InputError("the record has no steps (steps.csv is missing or empty), so its wall time cannot be split "
                         "into them")
    t0, t1 = float(served["arrival"].min()), float(served["finished"].max())
    if not t1 > t0:
        raise InputError("the record's last finish is not after its first arrival: no wall time to explain")
    overhead = metrics.retire_overhead(rec)
    segments = metrics.running_rows(rec)
    start, end, weight = _intervals(rec, overhead, segments, t0, t1)
    split = dict(zip(PARTS, _spread(start, end, weight, np.array([t0, t1]))[0].tolist()))
    edges = np.linspace(t0, t1, windows + 1)
    per_window = _spread(start, end, weight, edges)
    rows_s = _spread(segments["start"].to_numpy(float), segments["end"].to_numpy(float),
                     segments["rows"].to_numpy(float)[:, None], edges)[:, 0]
    arrivals = np.histogram(served["arrival"].to_numpy(float), edges)[0]
    length = np.diff(edges)
    win = pd.DataFrame({"start": edges[:-1], "end": edges[1:], "arrivals": arrivals,
                        "offered_rate": arrivals / length, "rows_mean": rows_s / length,
                        **{p: per_window[:, i] for i, p in enumerate(PARTS)}})
    held = segments.assign(d=segments["end"] - segments["start"]).groupby("rows")["d"].sum()
    top = max(int(rec.meta.get("max_batch") or 0), int(held.index.max()))
    rows = (held / (t1 - t0)).reindex(range(top + 1), fill_value=0.0)
    groups = metrics.groups_at_admission(rec)
    figures = _figures(rec, split, rows, groups, overhead, len(served), t1 - t0)
    return Explanation(rec.meta, t0, t1, split, win, rows, metrics.groups_by_depth(groups), figures,
                       _notes(rec, overhead))


def compare(a: Explanation, b: Explanation) -> pd.DataFrame:
    """The headline figures side by side: a, b, diff = b - a and rel = diff / a (NaN where a is 0 or missing)."""
    keys = [k for k in a.figures if k in b.figures]
    va = np.array([a.figures[k] for k in keys], float)
    vb = np.array([b.figures[k] for k in keys], float)
    diff = vb - va
    return pd.DataFrame({"a": va, "b": vb, "diff": diff, "rel": _div(diff, np.abs(va))}, index=keys)


def compare_windows(a: Explanation, b: Explanation) -> pd.DataFrame:
    """Window by window (each record's own windows, matched by position): b - a in offered rate, running rows and
    each part's share of its window."""
    n = min(len(a.windows), len(b.windows))
    wa, wb = a.windows.iloc[:n].reset_index(drop=True), b.windows.iloc[:n].reset_index(drop=True)
    la, lb = (wa["end"] - wa["start"]).to_numpy(), (wb["end"] - wb["start"]).to_numpy()
    out = pd.DataFrame({k: wb[k] - wa[k] for k in ("offered_rate", "rows_mean")})
    for p in PARTS:
        out[p] = _div(wb[p].to_numpy(), lb) - _div(wa[p].to_numpy(), la)
    return out


def _figures(rec: RunRecord, split: dict, rows: pd.Series, groups: pd.DataFrame, overhead: pd.DataFrame,
             served: int, wall: float) -> dict:
    referenced = overhead["reference"].notna()
    return {"wall_s": wall, "requests": served, "served_rate": served / wall,
            **{f"{p}_s": v for p, v in split.items()}, **{f"{p}_share": v / wall for p, v in split.items()},
            "rows_mean": float((rows.index.to_numpy() * rows.to_numpy()).sum()),
            "rows_p50": _quantile(rows, 0.5), "rows_p95": _quantile(rows, 0.95),
            "rows_full_share": float(rows.iloc[-1]),
            **{k: v for k, v in metrics.occupancy(rec).items() if k != "mean_running_rows"},
            "groups": len(groups), "group_size_p50": _pct(groups["size"], 50),
            "group_size_p95": _pct(groups["size"], 95), "group_size_max": _pct(groups["size"], 100),
            "padding_waste_p50": _pct(groups["waste"], 50), "padding_waste_p95": _pct(groups["waste"], 95),
            "retired_rows": int(overhead["retired"].sum()),
            "retire_ms_per_row": _div(overhead["overhead"].sum() * 1e3,
                                      float(overhead["retired"][referenced].sum()))}


def _notes(rec: RunRecord, overhead: pd.DataFrame) -> list[str]:
    notes = []
    decode = rec.steps["kind"] == "decode"
    if not decode.any() and (rec.requests["output_tokens"] > 1).any():
        notes.append("the record has no decode steps (a summary-only simulation?): decode time shows as untimed")
    unmatched = int(overhead["reference"].isna().sum())
    if unmatched:
        notes.append(f"{unmatched} decode step(s) that retired rows had no decode step of the same row count "
                     f"without retirement to compare with: their time counts as decode")
    return notes


def _intervals(rec: RunRecord, overhead: pd.DataFrame, segments: pd.DataFrame, t0: float,
               t1: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Intervals covering the wall time, each with its weight in every part (rows of `weight` sum to 1)."""
    steps = rec.steps
    pre = steps[steps["kind"] == "prefill"]
    dec = steps[steps["kind"] == "decode"]
    tokens, real = pre["tokens"].to_numpy(float), pre["prompt_tokens"].to_numpy(float)
    real_share = np.divide(real, tokens, out=np.ones_like(real), where=tokens > 0)
    retire = overhead["overhead"].reindex(dec.index, fill_value=0.0).to_numpy(float)
    ds, de = dec["start"].to_numpy(float), dec["end"].to_numpy(float)
    idle, untimed = _uncovered(steps, segments, t0, t1)
    parts = [(pre["start"].to_numpy(float), pre["end"].to_numpy(float),
              {"prefill": real_share, "padding": 1 - real_share}),
             (ds, de - retire, {"decode": 1.0}), (de - retire, de, {"retire": 1.0}),
             (untimed[0], untimed[1], {"untimed": 1.0}), (idle[0], idle[1], {"idle": 1.0})]
    start = np.concatenate([s for s, _, _ in parts])
    end = np.concatenate([e for _, e, _ in parts])
    weight = np.zeros((len(start), len(PARTS)))
    row = 0
    for s, _, w in parts:
        for p, v in w.items():
            weight[row:row + len(s), PARTS.index(p)] = v
        row += len(s)
    return start, end, weight


def _uncovered(steps: pd.DataFrame, segments: pd.DataFrame, t0: float,
               t1: float) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """The stretches of the wall time no step covers: (idle, untimed) as (starts, ends), split by whether a request
    held a row."""
    s, e = steps["start"].to_numpy(float), steps["end"].to_numpy(float)
    b = np.unique(np.concatenate(([t0, t1], s, e, segments["start"].to_numpy(float))))
    b = b[(b >= t0) & (b <= t1)]
    lo, hi = b[:-1], b[1:]
    covered = np.searchsorted(np.sort(s), lo, side="right") - np.searchsorted(np.sort(e), lo, side="right") > 0
    segment = np.clip(np.searchsorted(segments["start"].to_numpy(float), lo, side="right") - 1, 0, None)
    held = segments["rows"].to_numpy()[segment] > 0
    idle, untimed = ~covered & ~held, ~covered & held
    return (lo[idle], hi[idle]), (lo[untimed], hi[untimed])


def _spread(start: np.ndarray, end: np.ndarray, weight: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Weighted seconds of the intervals inside each window between consecutive edges: windows x weight columns."""
    out = np.zeros((len(edges) - 1, weight.shape[1]))
    for i, (w0, w1) in enumerate(zip(edges[:-1], edges[1:])):
        overlap = np.clip(np.minimum(end, w1) - np.maximum(start, w0), 0.0, None)
        out[i] = overlap @ weight
    return out


def _quantile(shares: pd.Series, q: float) -> float:
    """The time-weighted quantile of a distribution given as shares by value."""
    cum = shares.cumsum().to_numpy()
    if not len(cum) or not cum[-1] > 0:
        return math.nan
    return float(shares.index[np.searchsorted(cum, q * cum[-1])])


def _pct(values: pd.Series, q: float) -> float:
    v = values.to_numpy(float)
    v = v[np.isfinite(v)]
    return float(np.percentile(v, q)) if v.size else math.nan


def _div(num, den):
    num, den = np.asarray(num, float), np.asarray(den, float)
    out = np.divide(num, den, out=np.full(np.broadcast(num, den).shape, math.nan), where=den > 0)
    return float(out) if out.ndim == 0 else out
