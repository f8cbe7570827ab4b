"""What a sweep says: a table and a capacity bracket per configuration, the mechanism behind each, the
configurations ranked by capacity, and the files (sweep.csv, sweep.json, sweep.png; sweep.bands.csv when it ran
several workload seeds; sweep.run.json, how this run of it went).

With several seeds every number is reported as a band across them (servecap/sim/bands.py): mean, standard deviation,
min and max per rate, and the capacity bracket per seed with its spread. A sag past capacity is only called one
when the drop exceeds the seed spread.

With SLOs every point also has its goodput and SLO verdict, and capacity is the bracket by the SLOs, with the one by
stability beside it (per seed and as a band, with several seeds). A fleet's configuration names its replicas and
router; servecap/sim/fleet_report.py answers the fewest replicas that hold each rate.
"""
from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

from servecap.traces.bench_result import json_safe
from servecap.traces.csvio import atomic_write_text
from servecap.traces.formatting import fmt_ms
from servecap.traces.latency import DEFAULT_PERCENTILES, latency_keys, p_key
from servecap.traces.metrics import GOODPUT_FRACTION, slo_keys
from servecap.traces.slo import SLO, describe

from .bands import Band, exceeds_seed_spread
from .sweep import ConfigResult
from .sweep_plot import plot, title

SAG = 0.95  # past capacity, a served rate below this fraction of the peak is a sag worth explaining
MEMORY_BOUND = 0.10  # the head blocked by blocks this much of step time (with rows free) is memory-bound

CSV_COLUMNS = ("backend", "prefill", "max_batch", "pool_gib", "replicas", "router", "pool_blocks", "rate", "seed",
               "trace_id",
               "n", "served_rate", "expected_rate", "stable", "served_ok", "trend_rise_s", "queue_wait_p50",
               "queue_wait_p95", "ttft_p50", "ttft_p95", "tpot_p50", "group_size_p50", "group_size_p95",
               "group_size_max", "padding_waste_p50", "padding_waste_p95", "mean_running_rows", "rows_while_queued",
               "head_blocked_frac", "sim_events")
# sweep.run.json: how this run of the sweep went (host time, where, when): kept out of sweep.csv and sweep.json so
# that the same sweep writes the same bytes every time
RUN_POINT_KEYS = ("backend", "prefill", "admission", "prefix_cache", "max_batch", "pool_gib", "replicas", "router",
                  "rate", "seed", "sim_wall_s")
# The admission and cache axes and what they did (traces.metrics.memory_figures; empty for reserve without a cache)
MEMORY_COLUMNS = ("admission", "prefix_cache", "preemptions", "preempted_frac", "recompute_time_frac",
                  "prefix_hit_rate")
# (heading, row key, format) for the printed table; the latencies' columns (in ms) come from _latency_columns.
# `rate` is the nominal rate the trace was scaled to; `offered` what the trace's sample actually offered
# (servecap/traces/metrics.py: expected), which the served rate keeps up with.
_TABLE_HEAD = (("rate", "rate", "{:.3g}"), ("offered", "expected_rate", "{:.2f}"), ("served", "served_rate", "{:.2f}"))
_TABLE = (("group p50/p95/max", None, None), ("waste p50/p95", None, None),
          ("rows", "mean_running_rows", "{:.1f}"), ("blocked", "head_blocked_frac", "{:.0%}"),
          ("stable", "stable", None))
_LATENCIES = (("queue_wait", "wait"), ("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"))


def _latency_columns(percentiles: tuple[float, ...]) -> tuple:
    """The lowest and highest percentile of each latency in ms; ITL's mean alone (sweep points keep no token
    times, and the mean needs none: servecap/traces/latency.py)."""
    shown = sorted({min(percentiles), max(percentiles)})
    cols = []
    for metric, label in _LATENCIES:
        if metric == "itl":
            cols.append(("ITL mean ms", "mean_itl_ms", "ms"))
            continue
        cols += [(f"{label} {p_key(q)} ms" if i == 0 else p_key(q), f"{p_key(q)}_{metric}_ms", "ms")
                 for i, q in enumerate(shown)]
    return tuple(cols)
_SLO_TABLE = (("goodput", "goodput", "{:.2f}"), ("SLOs", "slo_ok", None))
BANDED = ("expected_rate", "served_rate", "queue_wait_p50")  # the quantities sweep.bands.csv and the figure give a band
SLO_BANDED = ("goodput",)  # and with SLOs
BAND_COLUMNS = ("backend", "prefill", "max_batch", "pool_gib", "replicas", "router", "pool_blocks", "rate", "seeds",
                "stable_seeds", *(f"{k}_{s}" for k in BANDED for s in ("mean", "sd", "min", "max")), "admission",
                "prefix_cache")
SLO_BAND_COLUMNS = ("slo_ok_seeds", *(f"{k}_{s}" for k in SLO_BANDED for s in ("mean", "sd", "min", "max")))


def _cell(row: dict, key: str | None, fmt: str | None, heading: str) -> str:
    if heading.startswith("group"):
        return "/".join(f"{row[k]:.0f}" for k in ("group_size_p50", "group_size_p95", "group_size_max"))
    if heading.startswith("waste"):
        return "/".join(f"{row[k]:.2f}" for k in ("padding_waste_p50", "padding_waste_p95"))
    value = row.get(key)  # a point kept before the figure existed (a resumed sweep) has none
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if fmt == "ms":
        return fmt_ms(value)
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt.format(value)


def table(res: ConfigResult, slos: tuple[SLO, ...] = (), percentiles: tuple[float, ...] = DEFAULT_PERCENTILES) -> str:
    """The configuration's points, one line per rate (latencies in ms, rates in requests per second)."""
    cols = _TABLE_HEAD + _latency_columns(percentiles) + _TABLE + (_SLO_TABLE if slos else ())
    cells = [[h for h, _, _ in cols]] + [[_cell(r, k, f, h) for h, k, f in cols] for r in _by_rate(res)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells)


def _by_rate(res: ConfigResult) -> list[dict]:
    return sorted(res.rows, key=lambda r: r["rate"])


def by_config(results: list[ConfigResult]) -> list[list[ConfigResult]]:
    """The results grouped per configuration (one per seed), in the sweep's order."""
    groups: dict = {}
    for res in results:
        groups.setdefault(res.config, []).append(res)
    return list(groups.values())


def _bracket(lo: float | None, hi: float | None, rates: list[float], held: str, missed: str) -> str:
    if hi is None:
        return f"{held} at every tested rate: capacity is above {max(rates):.3g} req/s"
    if lo is None:
        return f"{missed} at every tested rate: capacity is below {hi:.3g} req/s"
    return f"capacity between {lo:.3g} and {hi:.3g} req/s"


def capacity(res: ConfigResult, slos: tuple[SLO, ...] = ()) -> str:
    """The capacity bracket by stability, or with SLOs by the SLOs first and by stability beside it."""
    by_stability = _bracket(*res.bracket, res.rates, "stable", "unstable")
    if not slos:
        return by_stability
    by_slos = _bracket(*res.slo_bracket, res.rates, "SLOs met", "SLOs missed")
    return f"by the SLOs {by_slos}; by stability {by_stability}"


def slo_definition(slos: tuple[SLO, ...]) -> str:
    return (f"capacity by the SLOs: the highest rate at which {describe(slos)}, for all but "
            f"{1 - GOODPUT_FRACTION:.0%} of requests (goodput within {1 - GOODPUT_FRACTION:.0%} of the served rate), "
            f"the served rate keeps up with the offered and every percentile named is within its limit")


def _fmt_band(b: Band, spec: str = ".3g") -> str:
    return "-" if b.n == 0 else f"{b.min:{spec}} to {b.max:{spec}} (mean {b.mean:{spec}}" + \
        ("" if math.isnan(b.sd) else f", sd {b.sd:{spec}}") + ")"


def _bracket_bands(group: list[ConfigResult], brackets: list[tuple], held: str, missed: str) -> str:
    per_seed = "; ".join(f"seed {res.seed}: " + "-".join("?" if x is None else f"{x:.3g}" for x in b)
                         for res, b in zip(group, brackets))
    return (f"highest {held} rate {_fmt_band(Band.of([lo for lo, _ in brackets]))}, "
            f"lowest {missed} rate {_fmt_band(Band.of([hi for _, hi in brackets]))} req/s ({per_seed})")


def capacity_bands(group: list[ConfigResult], slos: tuple[SLO, ...] = ()) -> str:
    """The capacity bracket of each seed and its spread across them; with SLOs, by the SLOs first and by stability
    beside it."""
    by_stability = _bracket_bands(group, [res.bracket for res in group], "stable", "unstable")
    if not slos:
        return f"capacity bracket across {len(group)} seeds: {by_stability}"
    by_slos = _bracket_bands(group, [res.slo_bracket for res in group], "SLO-meeting", "SLO-missing")
    return f"capacity bracket across {len(group)} seeds: by the SLOs {by_slos}; by stability {by_stability}"


_NOT_AVERAGED = ("rate", "seed", "max_batch", "pool_gib", "replicas", "pool_blocks")  # the point's identity


def _most(rows: list[dict], key: str) -> bool:
    return sum(bool(r[key]) for r in rows) * 2 > len(rows)


def mean_result(group: list[ConfigResult]) -> ConfigResult:
    """The configuration's points averaged across seeds, rate by rate; a rate is stable (meets the SLOs) when most
    seeds are (do)."""
    first = group[0]
    rows = []
    for rate in sorted({r["rate"] for res in group for r in res.rows}):
        at = [r for res in group for r in res.rows if r["rate"] == rate]
        row = dict(at[0], seed=None)
        for k, v in at[0].items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in _NOT_AVERAGED:
                row[k] = Band.of([r[k] for r in at]).mean
        row["stable"] = _most(at, "stable")
        if "slo_ok" in row:
            row["slo_ok"] = _most(at, "slo_ok")
        rows.append(row)
    return ConfigResult(first.config, first.pool_blocks, first.rates, first.estimate, rows)


def mechanism(res: ConfigResult, seeds: list[ConfigResult] | None = None) -> list[str]:
    """Why the configuration behaves as it does past capacity: the sag (or its absence) and the pool.

    With `seeds` (the per-seed results `res` averages) a sag must also exceed the seed spread: the drop from the
    peak rate to the last one is compared seed by seed."""
    rows = _by_rate(res)
    _, hi = res.bracket
    past = [r for r in rows if hi is not None and r["rate"] >= hi]
    if not past:
        return ["no tested rate is past capacity; sweep higher rates to see what limits it"]
    first, last = past[0], past[-1]
    peak = max(rows, key=lambda r: r["served_rate"])
    groups = (f"admission groups p95 {first['group_size_p95']:.0f} -> {last['group_size_p95']:.0f} "
              f"(max {last['group_size_max']:.0f}), padding waste p95 {first['padding_waste_p95']:.2f} -> "
              f"{last['padding_waste_p95']:.2f} padded positions per prompt token")
    sags = last["served_rate"] < SAG * peak["served_rate"]
    spread = ""
    if seeds and len(seeds) > 1:
        at_peak, at_last = ([next(r["served_rate"] for r in s.rows if r["rate"] == x["rate"]) for s in seeds]
                            for x in (peak, last))
        drop = Band.of([1 - b / a for a, b in zip(at_peak, at_last)])
        beyond = exceeds_seed_spread(at_peak, at_last, paired=True)
        spread = (f"; drop {drop.mean:.1%} +/- {drop.sd:.1%} sd across {drop.n} seeds: "
                  f"{'beyond' if beyond else 'within'} the seed spread")
        sags = sags and beyond
    if sags:
        lines = [f"past capacity the served rate sags from {peak['served_rate']:.2f} req/s (at rate "
                 f"{peak['rate']:.3g}) to {last['served_rate']:.2f} (at rate {last['rate']:.3g}{spread}): the queue "
                 f"deepens (wait p50 {first['queue_wait_p50']:.1f} -> {last['queue_wait_p50']:.1f} s), {groups}, so "
                 f"each prefill spends more of the engine's time on padding"]
    else:
        lines = [f"past capacity the served rate holds near {last['served_rate']:.2f} req/s (peak "
                 f"{peak['served_rate']:.2f}{spread}), no sag: {groups}"]
    batch = res.config.max_batch
    if last["head_blocked_frac"] >= MEMORY_BOUND:
        lines.append(f"memory-bound: at {last['rate']:.3g} req/s only {last['rows_while_queued']:.1f} of {batch} rows "
                     f"run while requests wait, and the queue head waits for KV blocks with rows free "
                     f"{last['head_blocked_frac']:.0%} of step time: the {res.config.pool} pool "
                     f"({res.pool_blocks} blocks), not compute, sets capacity")
    else:
        lines.append(f"compute-bound: at {last['rate']:.3g} req/s {last['rows_while_queued']:.1f} of {batch} rows run "
                     f"while requests wait; the pool held the queue head back {last['head_blocked_frac']:.0%} of "
                     f"step time")
    return lines


def band_rows(group: list[ConfigResult], slos: tuple[SLO, ...] = ()) -> list[dict]:
    """One row per rate: each BANDED quantity's band across the seeds, and how many seeds were stable there; with
    SLOs also how many met them, and goodput's band."""
    cfg = group[0].config
    out = []
    for rate in sorted({r["rate"] for res in group for r in res.rows}):
        at = [r for res in group for r in res.rows if r["rate"] == rate]
        row = {**cfg.axes(), "pool_blocks": group[0].pool_blocks, "rate": rate,
               "seeds": len(at), "stable_seeds": sum(bool(r["stable"]) for r in at)}
        if slos:
            row["slo_ok_seeds"] = sum(bool(r["slo_ok"]) for r in at)
        for k in BANDED + (SLO_BANDED if slos else ()):
            b = Band.of([r[k] for r in at])
            row.update({f"{k}_mean": b.mean, f"{k}_sd": b.sd, f"{k}_min": b.min, f"{k}_max": b.max})
        out.append(row)
    return out


def band_table(group: list[ConfigResult], slos: tuple[SLO, ...] = ()) -> str:
    """The configuration's band per rate: offered and served rate and queue wait p50 (and goodput, with SLOs) as
    mean +/- sd [min, max] across seeds, and how many seeds were stable (met the SLOs)."""
    banded = (("expected_rate", "offered"), ("served_rate", "served"), ("queue_wait_p50", "wait p50 ms")) + \
        ((("goodput", "goodput"),) if slos else ())
    scale = {"queue_wait_p50": 1000.0}  # seconds in sweep.bands.csv, ms here
    cells = [["rate", *(f"{name} mean +/- sd [min, max]" for _, name in banded), "stable seeds",
              *(["SLOs met seeds"] if slos else [])]]
    for r in band_rows(group, slos):
        cells.append([f"{r['rate']:.3g}"] + [
            " ".join(f.format(r[k + s] * scale.get(k, 1.0)) for f, s in (("{:.2f}", "_mean"), ("+/- {:.2f}", "_sd"),
                                                                           ("[{:.2f},", "_min"), ("{:.2f}]", "_max")))
            for k, _ in banded] + [f"{r['stable_seeds']}/{r['seeds']}"] +
            ([f"{r['slo_ok_seeds']}/{r['seeds']}"] if slos else []))
    widths = [max(len(c[i]) for c in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells)


def report(results: list[ConfigResult], slos: tuple[SLO, ...] = (),
           percentiles: tuple[float, ...] = DEFAULT_PERCENTILES) -> str:
    parts = [slo_definition(slos)] if slos else []
    for group in by_config(results):
        res = group[0]
        estimate = f" (saturated estimate {res.estimate:.3g} req/s)" if res.estimate else ""
        if len(group) == 1:
            parts.append(f"\n{res.config.label} ({res.pool_blocks} blocks): {capacity(res, slos)}{estimate}")
            parts.append(table(res, slos, percentiles))
            parts.extend(f"  - {line}" for line in mechanism(res))
        else:
            parts.append(f"\n{res.config.label} ({res.pool_blocks} blocks), {len(group)} workload seeds{estimate}: "
                         f"{capacity_bands(group, slos)}")
            parts.append(band_table(group, slos))
            parts.extend(f"  - {line}" for line in mechanism(mean_result(group), group))
    if len(by_config(results)) > 1:
        parts += ["", *ranking(results, slos)]
    return "\n".join(parts)


def _copy_of(config, other) -> str:
    """How a ranking line names the configuration `config` repeats: by its pool where that is all they differ by."""
    a, b = config.axes(), other.axes()
    if [k for k in a if a[k] != b[k]] == ["pool_gib"]:
        return f"pool {other.pool}: the pool does not bind"
    return other.label


def ranking(results: list[ConfigResult], slos: tuple[SLO, ...] = ()) -> list[str]:
    """The configurations by capacity, highest first (with several seeds, the bracket of their rate-by-rate majority,
    as the band tables' verdicts): the sweep's answer in one place. A configuration whose every point is another's
    (a pool that never binds) is named as that one's copy."""
    rows, seen = [], {}
    for group in by_config(results):
        res = mean_result(group) if len(group) > 1 else group[0]
        lo, hi = res.slo_bracket if slos else res.bracket
        points = tuple((r["rate"], round(r["served_rate"], 9), round(r["queue_wait_p50"], 9)) for r in _by_rate(res))
        same = seen.setdefault(points, res.config)
        if hi is None:
            text = f"above {max(res.rates):.3g} req/s (every tested rate held)"
        elif lo is None:
            text = f"below {hi:.3g} req/s (no tested rate held)"
        else:
            text = f"{lo:.3g}-{hi:.3g} req/s"
        copy = "" if same == res.config else f"  (the same at every point as {_copy_of(res.config, same)})"
        rows.append((math.inf if hi is None else lo or 0.0, hi or math.inf, text, res.config.label + copy))
    rows.sort(key=lambda r: (-r[0], -r[1]))
    width = max(len(r[2]) for r in rows)
    head = (f"capacity by configuration, highest first ({'by the SLOs' if slos else 'by stability'}: the highest "
            f"rate that held - the lowest that did not):")
    foot = "  (brackets that overlap are not told apart at the grid's rates; `sim capacity` finds one to within 1%)"
    return [head] + [f"  {text:<{width}}  {label}" for _, _, text, label in rows] + [foot]


def _csv(rows: list[dict], columns: tuple[str, ...]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, columns, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def _config_doc(group: list[ConfigResult], slos: tuple[SLO, ...]) -> dict:
    res = group[0]
    doc = {"label": res.config.label, **res.config.axes(), "pool_blocks": res.pool_blocks, "rates": res.rates,
           "capacity_estimate": res.estimate, "capacity_by": "slos" if slos else "stability"}
    if len(group) == 1:
        return {**doc, "capacity_lo": res.bracket[0], "capacity_hi": res.bracket[1],
                **({"slo_capacity_lo": res.slo_bracket[0], "slo_capacity_hi": res.slo_bracket[1]} if slos else {}),
                "capacity": capacity(res, slos), "mechanism": mechanism(res)}
    brackets = [r.bracket for r in group]
    slo_brackets = [r.slo_bracket for r in group] if slos else [(None, None)] * len(group)
    return {**doc, "seeds": [r.seed for r in group],
            "capacity_per_seed": [{"seed": r.seed, "capacity_lo": lo, "capacity_hi": hi,
                                   **({"slo_capacity_lo": slo_lo, "slo_capacity_hi": slo_hi} if slos else {})}
                                  for r, (lo, hi), (slo_lo, slo_hi) in zip(group, brackets, slo_brackets)],
            "capacity_lo_band": vars(Band.of([lo for lo, _ in brackets])),
            "capacity_hi_band": vars(Band.of([hi for _, hi in brackets])),
            **({"slo_capacity_lo_band": vars(Band.of([lo for lo, _ in slo_brackets])),
                "slo_capacity_hi_band": vars(Band.of([hi for _, hi in slo_brackets]))} if slos else {}),
            "capacity": capacity_bands(group, slos), "mechanism": mechanism(mean_result(group), group),
            "bands": band_rows(group, slos)}


def write_files(out_dir: Path, results: list[ConfigResult], meta: dict, run: dict, slos: tuple[SLO, ...] = (),
                percentiles: tuple[float, ...] = DEFAULT_PERCENTILES) -> list[Path]:
    """sweep.csv (a row per point and seed), sweep.json (meta, configurations with bracket and mechanism, points),
    sweep.png, and with several seeds sweep.bands.csv (a row per configuration and rate: bands across seeds).
    With SLOs, the points gain their SLO scores and the configurations their bracket by the SLOs. sweep.run.json
    holds `run` (provenance: when, where, the command) and each point's host wall time."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [r for res in results for r in _by_rate(res)]
    columns = CSV_COLUMNS + tuple(slo_keys(slos)) + tuple(latency_keys(percentiles)) + MEMORY_COLUMNS  # new last
    atomic_write_text(out_dir / "sweep.csv", _csv(rows, columns))
    groups = by_config(results)
    files = [out_dir / "sweep.csv", out_dir / "sweep.json", out_dir / "sweep.png"]
    if any(len(g) > 1 for g in groups):
        atomic_write_text(out_dir / "sweep.bands.csv", _csv([b for g in groups for b in band_rows(g, slos)],
                                                            BAND_COLUMNS + (SLO_BAND_COLUMNS if slos else ())))
        files.append(out_dir / "sweep.bands.csv")
    doc = {"schema": "sim-sweep", "version": 1, **meta, "configurations": [_config_doc(g, slos) for g in groups],
           "trace_ids": sorted({r["trace_id"] for r in rows}),
           "points": [{k: r.get(k) for k in columns} for r in rows]}
    atomic_write_text(out_dir / "sweep.json", json.dumps(json_safe(doc), indent=1) + "\n")
    run_doc = {"schema": "sim-sweep-run", "version": 1, **run, "points": [{k: r[k] for k in RUN_POINT_KEYS} for r in rows]}
    atomic_write_text(out_dir / "sweep.run.json", json.dumps(json_safe(run_doc), indent=1) + "\n")
    plot([(g, band_rows(g)) for g in groups], out_dir / "sweep.png", title(meta), meta.get("interval"))
    return files + [out_dir / "sweep.run.json"]
