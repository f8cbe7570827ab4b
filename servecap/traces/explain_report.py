"""The text `python -m traces explain` prints: one record's explanation, or two side by side with their
differences. Tables only; the numbers come from traces.explain."""
from __future__ import annotations

import math

import pandas as pd

from .explain import PARTS, Explanation, compare, compare_windows

PART_LABELS = {"decode": "decode", "prefill": "prefill, real prompt tokens", "padding": "prefill, padding",
               "retire": "retire overhead (estimated)", "untimed": "between steps (untimed)",
               "idle": "idle (no step, no row held)"}
# The headline figures in the comparison table: key, label, format (a percent format takes a fraction).
HEADLINE = [("wall_s", "wall time (s)", ".3f"), ("requests", "requests", ".0f"),
            ("served_rate", "served rate, requests / wall time (req/s)", ".2f"),
            *[(f"{p}_s", f"{PART_LABELS[p]} (s)", ".3f") for p in PARTS],
            *[(f"{p}_share", f"{PART_LABELS[p]} (share)", ".1%") for p in PARTS],
            ("rows_mean", "rows running, mean", ".2f"), ("rows_p50", "rows running, p50", ".0f"),
            ("rows_p95", "rows running, p95", ".0f"), ("rows_full_share", "time at a full batch", ".1%"),
            ("rows_while_queued", "rows running while requests queued", ".2f"),
            ("head_blocked_frac", "head blocked by the pool (of time rows ran)", ".1%"),
            ("groups", "admission groups", ".0f"), ("group_size_p50", "group size p50", ".1f"),
            ("group_size_p95", "group size p95", ".1f"), ("group_size_max", "group size max", ".0f"),
            ("padding_waste_p50", "padding waste p50 (per real token)", ".3f"),
            ("padding_waste_p95", "padding waste p95 (per real token)", ".3f"),
            ("retired_rows", "rows retired", ".0f"), ("retire_ms_per_row", "retire overhead per row (ms)", ".3f")]
RULES = ["wall time: first arrival to last finish; every instant of it falls in exactly one part",
         "prefill steps are split by positions: real new prompt tokens against padding = tokens - prompt_tokens "
         "(a prefill row starts at its pass's start, so admission work is inside it)",
         "retire overhead: a decode step that retired rows, less the median of the nearest decode steps of the "
         "same row count that retired none (traces.metrics.retire_overhead)",
         "untimed: no step row covers the time while a request holds a row; idle: no step and no row held",
         "windows: equal parts of the wall time; offered rate = arrivals in the window / its length"]


def _f(v, spec: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return format(v, spec)


def _describe(name: str, e: Explanation) -> list[str]:
    m = e.meta
    trace = m.get("trace") if isinstance(m.get("trace"), dict) else {}
    what = ", ".join(x for x in (m.get("kind"), m.get("backend") and f"{m['backend']} decode",
                                 f"{m.get('prefill', 'padded')} prefill",
                                 m.get("max_batch") and f"max batch {m['max_batch']}",
                                 m.get("pool_blocks") and f"pool {m['pool_blocks']} blocks") if x)
    traced = ", ".join(([str(trace["kind"])] if "kind" in trace else []) +
                       [f"{k} {trace[k]}" for k in ("n", "rate", "seed") if k in trace])
    f = e.figures
    return [f"{name}: {what}" + (f"; trace {traced}" if traced else ""),
            f"  wall time {e.wall:.3f} s (first arrival {e.start:.3f} s to last finish {e.end:.3f} s): "
            f"{f['requests']} requests served, {_f(f['served_rate'], '.2f')} req/s over the wall time"]


def _split_table(e: Explanation) -> str:
    rows = [(PART_LABELS[p], e.split[p], e.split[p] / e.wall if e.wall > 0 else math.nan) for p in PARTS]
    rows.append(("total", sum(e.split.values()), sum(e.split.values()) / e.wall if e.wall > 0 else math.nan))
    return "\n".join([f"  {'where the time goes':<32}{'seconds':>10}{'share':>9}"] +
                     [f"  {label:<32}{s:>10.3f}{_f(share, '.1%'):>9}" for label, s, share in rows])


def _windows_table(w: pd.DataFrame, diff: bool = False) -> str:
    head = f"  {'window':<8}{'from-to (s)':>18}{'offered/s':>11}{'rows':>7}" + "".join(f"{p:>9}" for p in PARTS)
    lines = [head]
    length = (w["end"] - w["start"]).to_numpy() if "start" in w else None
    for i in range(len(w)):
        r = w.iloc[i]
        span = f"{r['start']:.2f}-{r['end']:.2f}" if length is not None else ""
        shares = [r[p] if diff else (r[p] / length[i] if length[i] > 0 else math.nan) for p in PARTS]
        spec = "+.1f" if diff else ".2f"
        lines.append(f"  {i + 1:<8}{span:>18}{_f(r['offered_rate'], spec):>11}{_f(r['rows_mean'], spec):>7}" +
                     "".join(f"{_f(s * 100, '+.1f') + 'pp' if diff else _f(s, '.1%'):>9}" for s in shares))
    return "\n".join(lines)


def _groups_table(g: pd.DataFrame) -> str:
    if g.empty:
        return "  no admission groups"
    lines = [f"  {'queue depth':<13}{'groups':>7}{'size mean':>10}{'p50':>6}{'max':>6}{'waste p50':>11}{'p95':>7}"
             f"{'padding s':>11}"]
    for r in g.itertuples():
        depth = f"{r.depth_lo}" if r.depth_lo == r.depth_hi else f"{r.depth_lo}-{r.depth_hi}"
        lines.append(f"  {depth:<13}{r.groups:>7}{r.size_mean:>10.2f}{_f(r.size_p50, '.0f'):>6}"
                     f"{_f(r.size_max, '.0f'):>6}{_f(r.waste_p50, '.3f'):>11}{_f(r.waste_p95, '.3f'):>7}"
                     f"{r.padding_s:>11.3f}")
    return "\n".join(lines)


def _rows_lines(e: Explanation) -> list[str]:
    f, rows = e.figures, e.rows
    top = len(rows) - 1
    width = max(1, math.ceil(top / 8))  # at most nine bins: none running, then equal ranges up to the batch
    bins = [(0, 0)] + [(lo, min(lo + width - 1, top)) for lo in range(1, top + 1, width)]
    hist = "  ".join(f"{lo if lo == hi else f'{lo}-{hi}'}: {rows.loc[lo:hi].sum():.1%}" for lo, hi in bins)
    return [f"  rows running (time-weighted): mean {_f(f['rows_mean'], '.2f')}, p50 {_f(f['rows_p50'], '.0f')}, "
            f"p95 {_f(f['rows_p95'], '.0f')} of {top}; a full batch {_f(f['rows_full_share'], '.1%')} of the time; "
            f"{_f(f['rows_while_queued'], '.2f')} on average while requests queued",
            f"  head-of-line blocking on the pool: the queue head waited for KV blocks with a row free "
            f"{_f(f['head_blocked_frac'], '.1%')} of the time rows ran",
            f"  rows: {hist}"]


def _footer(named: list[tuple[str, Explanation]]) -> list[str]:
    notes = [f"  {name}: {n}" for name, e in named for n in e.notes]
    return ["", "rules:"] + [f"  {r}" for r in RULES] + (["", "notes:"] + notes if notes else [])


def report(e: Explanation, name: str) -> str:
    """One record's explanation as text."""
    out = _describe(name, e) + ["", _split_table(e), "", "  by window (each part's share of the window)",
                                _windows_table(e.windows), "", "  admission groups by queue depth at admission",
                                _groups_table(e.groups), ""] + _rows_lines(e)
    return "\n".join(out + _footer([(name, e)]))


def report_pair(a: Explanation, b: Explanation, names: tuple[str, str]) -> str:
    """Two records side by side: the headline figures with their differences, then each one's tables."""
    c = compare(a, b)
    na, nb = names
    lines = _describe(f"A {na}", a) + _describe(f"B {nb}", b) + [
        "", f"  {'':<46}{'A':>11}{'B':>11}{'B - A':>11}{'(B-A)/A':>9}"]
    for key, label, spec in HEADLINE:
        if key not in c.index:
            continue
        r = c.loc[key]
        diff_spec = ("+" + spec.replace("%", "f")) if spec.endswith("%") else "+" + spec
        diff = _f(r["diff"] * 100, diff_spec) + "pp" if spec.endswith("%") else _f(r["diff"], diff_spec)
        lines.append(f"  {label:<46}{_f(r['a'], spec):>11}{_f(r['b'], spec):>11}{diff:>11}{_f(r['rel'], '+.1%'):>9}")
    lines += ["", f"  by window, A ({na})", _windows_table(a.windows), "", f"  by window, B ({nb})",
              _windows_table(b.windows), "", "  by window, B - A (window by window, each record's own windows)",
              _windows_table(compare_windows(a, b), diff=True)]
    for tag, name, e in (("A", na, a), ("B", nb, b)):
        lines += ["", f"  admission groups by queue depth at admission, {tag} ({name})", _groups_table(e.groups)]
    for tag, name, e in (("A", na, a), ("B", nb, b)):
        lines += ["", f"  {tag} ({name})"] + _rows_lines(e)
    return "\n".join(lines + _footer([(f"A {na}", a), (f"B {nb}", b)]))
