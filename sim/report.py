"""What a sweep says: a table and a capacity bracket per configuration, the mechanism behind each, and the
files (sweep.csv, sweep.json, sweep.png; sweep.bands.csv when it ran several workload seeds).

With several seeds every number is reported as a band across them (sim/bands.py): mean, standard deviation,
min and max per rate, and the capacity bracket per seed with its spread. A sag past capacity is only called one
when the drop exceeds the seed spread.
"""
from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

from traces.csvio import atomic_write_text

from .bands import Band, exceeds_seed_spread
from .sweep import ConfigResult

SAG = 0.95  # past capacity, a served rate below this fraction of the peak is a sag worth explaining
MEMORY_BOUND = 0.10  # the head blocked by blocks this much of step time (with rows free) is memory-bound

CSV_COLUMNS = ("backend", "max_batch", "pool_gib", "pool_blocks", "rate", "seed", "trace_id", "n", "served_rate",
               "expected_rate", "stable", "served_ok", "trend_rise_s", "queue_wait_p50", "queue_wait_p95",
               "ttft_p50", "ttft_p95", "tpot_p50", "group_size_p50", "group_size_p95", "group_size_max",
               "padding_waste_p50", "padding_waste_p95", "mean_running_rows", "rows_while_queued",
               "head_blocked_frac", "sim_events", "sim_wall_s")
# (heading, row key, format) for the printed table
_TABLE = (("rate", "rate", "{:.3g}"), ("served", "served_rate", "{:.2f}"), ("wait p50", "queue_wait_p50", "{:.2f}"),
          ("p95", "queue_wait_p95", "{:.2f}"), ("TTFT p50", "ttft_p50", "{:.2f}"), ("p95", "ttft_p95", "{:.2f}"),
          ("TPOT p50", "tpot_p50", "{:.3f}"), ("group p50/p95/max", None, None), ("waste p50/p95", None, None),
          ("rows", "mean_running_rows", "{:.1f}"), ("blocked", "head_blocked_frac", "{:.0%}"),
          ("stable", "stable", None))
BANDED = ("served_rate", "queue_wait_p50")  # the quantities sweep.bands.csv and the figure give a band
BAND_COLUMNS = ("backend", "prefill", "max_batch", "pool_gib", "pool_blocks", "rate", "seeds", "stable_seeds",
                *(f"{k}_{s}" for k in BANDED for s in ("mean", "sd", "min", "max")))


def _cell(row: dict, key: str | None, fmt: str | None, heading: str) -> str:
    if heading.startswith("group"):
        return "/".join(f"{row[k]:.0f}" for k in ("group_size_p50", "group_size_p95", "group_size_max"))
    if heading.startswith("waste"):
        return "/".join(f"{row[k]:.2f}" for k in ("padding_waste_p50", "padding_waste_p95"))
    value = row[key]
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt.format(value)


def table(res: ConfigResult) -> str:
    """The configuration's points, one line per rate (times in seconds, rates in requests per second)."""
    cells = [[h for h, _, _ in _TABLE]] + [[_cell(r, k, f, h) for h, k, f in _TABLE] for r in _by_rate(res)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(_TABLE))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells)


def _by_rate(res: ConfigResult) -> list[dict]:
    return sorted(res.rows, key=lambda r: r["rate"])


def by_config(results: list[ConfigResult]) -> list[list[ConfigResult]]:
    """The results grouped per configuration (one per seed), in the sweep's order."""
    groups: dict = {}
    for res in results:
        groups.setdefault(res.config, []).append(res)
    return list(groups.values())


def capacity(res: ConfigResult) -> str:
    lo, hi = res.bracket
    if hi is None:
        return f"stable at every tested rate: capacity is above {max(res.rates):.3g} req/s"
    if lo is None:
        return f"unstable at every tested rate: capacity is below {hi:.3g} req/s"
    return f"capacity between {lo:.3g} and {hi:.3g} req/s"


def _fmt_band(b: Band, spec: str = ".3g") -> str:
    return "-" if b.n == 0 else f"{b.min:{spec}} to {b.max:{spec}} (mean {b.mean:{spec}}" + \
        ("" if math.isnan(b.sd) else f", sd {b.sd:{spec}}") + ")"


def capacity_bands(group: list[ConfigResult]) -> str:
    """The capacity bracket of each seed and its spread across them."""
    brackets = [res.bracket for res in group]
    per_seed = "; ".join(f"seed {res.seed}: " + "-".join("?" if x is None else f"{x:.3g}" for x in b)
                         for res, b in zip(group, brackets))
    return (f"capacity bracket across {len(group)} seeds: highest stable rate {_fmt_band(Band.of([lo for lo, _ in brackets]))}, "
            f"lowest unstable rate {_fmt_band(Band.of([hi for _, hi in brackets]))} req/s ({per_seed})")


def mean_result(group: list[ConfigResult]) -> ConfigResult:
    """The configuration's points averaged across seeds, rate by rate; a rate is stable when most seeds are."""
    first = group[0]
    rows = []
    for rate in sorted({r["rate"] for res in group for r in res.rows}):
        at = [r for res in group for r in res.rows if r["rate"] == rate]
        row = dict(at[0], seed=None)
        for k, v in at[0].items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("rate", "max_batch", "pool_gib",
                                                                                      "pool_blocks"):
                row[k] = Band.of([r[k] for r in at]).mean
        row["stable"] = sum(bool(r["stable"]) for r in at) * 2 > len(at)
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
        lines = [f"past capacity the served rate sags from {peak['served_rate']:.2f} req/s (offered "
                 f"{peak['rate']:.3g}) to {last['served_rate']:.2f} (offered {last['rate']:.3g}{spread}): the queue "
                 f"deepens (wait p50 {first['queue_wait_p50']:.1f} -> {last['queue_wait_p50']:.1f} s), {groups}, so "
                 f"each prefill spends more of the engine's time on padding"]
    else:
        lines = [f"past capacity the served rate holds near {last['served_rate']:.2f} req/s (peak "
                 f"{peak['served_rate']:.2f}{spread}), no sag: {groups}"]
    batch = res.config.max_batch
    if last["head_blocked_frac"] >= MEMORY_BOUND:
        lines.append(f"memory-bound: at {last['rate']:.3g} req/s only {last['rows_while_queued']:.1f} of {batch} rows "
                     f"run while requests wait, and the queue head waits for KV blocks with rows free "
                     f"{last['head_blocked_frac']:.0%} of step time: the {res.config.pool_gib:g} GiB pool "
                     f"({res.pool_blocks} blocks), not compute, sets capacity")
    else:
        lines.append(f"compute-bound: at {last['rate']:.3g} req/s {last['rows_while_queued']:.1f} of {batch} rows run "
                     f"while requests wait; the pool held the queue head back {last['head_blocked_frac']:.0%} of "
                     f"step time")
    return lines


def band_rows(group: list[ConfigResult]) -> list[dict]:
    """One row per rate: each BANDED quantity's band across the seeds, and how many seeds were stable there."""
    cfg = group[0].config
    out = []
    for rate in sorted({r["rate"] for res in group for r in res.rows}):
        at = [r for res in group for r in res.rows if r["rate"] == rate]
        row = {"backend": cfg.backend, "prefill": cfg.prefill, "max_batch": cfg.max_batch, "pool_gib": cfg.pool_gib,
               "pool_blocks": group[0].pool_blocks, "rate": rate, "seeds": len(at),
               "stable_seeds": sum(bool(r["stable"]) for r in at)}
        for k in BANDED:
            b = Band.of([r[k] for r in at])
            row.update({f"{k}_mean": b.mean, f"{k}_sd": b.sd, f"{k}_min": b.min, f"{k}_max": b.max})
        out.append(row)
    return out


def band_table(group: list[ConfigResult]) -> str:
    """The configuration's band per rate: served rate and queue wait p50 as mean +/- sd [min, max] across seeds."""
    cells = [["rate", "served mean +/- sd [min, max]", "wait p50 mean +/- sd [min, max]", "stable seeds"]]
    for r in band_rows(group):
        cells.append([f"{r['rate']:.3g}"] + [
            f"{r[k + '_mean']:.{d}f} +/- {r[k + '_sd']:.{d}f} [{r[k + '_min']:.{d}f}, {r[k + '_max']:.{d}f}]"
            for k, d in (("served_rate", 2), ("queue_wait_p50", 2))] + [f"{r['stable_seeds']}/{r['seeds']}"])
    widths = [max(len(c[i]) for c in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells)


def report(results: list[ConfigResult]) -> str:
    parts = []
    for group in by_config(results):
        res = group[0]
        estimate = f" (saturated estimate {res.estimate:.3g} req/s)" if res.estimate else ""
        if len(group) == 1:
            parts.append(f"\n{res.config.label} ({res.pool_blocks} blocks): {capacity(res)}{estimate}")
            parts.append(table(res))
            parts.extend(f"  - {line}" for line in mechanism(res))
        else:
            parts.append(f"\n{res.config.label} ({res.pool_blocks} blocks), {len(group)} workload seeds{estimate}: "
                         f"{capacity_bands(group)}")
            parts.append(band_table(group))
            parts.extend(f"  - {line}" for line in mechanism(mean_result(group), group))
    return "\n".join(parts)


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _csv(rows: list[dict], columns: tuple[str, ...]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, columns, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def _config_doc(group: list[ConfigResult]) -> dict:
    res = group[0]
    doc = {"label": res.config.label, "backend": res.config.backend, "prefill": res.config.prefill,
           "max_batch": res.config.max_batch, "pool_gib": res.config.pool_gib, "pool_blocks": res.pool_blocks,
           "rates": res.rates, "capacity_estimate": res.estimate}
    if len(group) == 1:
        return {**doc, "capacity_lo": res.bracket[0], "capacity_hi": res.bracket[1], "capacity": capacity(res),
                "mechanism": mechanism(res)}
    brackets = [r.bracket for r in group]
    return {**doc, "seeds": [r.seed for r in group],
            "capacity_per_seed": [{"seed": r.seed, "capacity_lo": lo, "capacity_hi": hi}
                                  for r, (lo, hi) in zip(group, brackets)],
            "capacity_lo_band": vars(Band.of([lo for lo, _ in brackets])),
            "capacity_hi_band": vars(Band.of([hi for _, hi in brackets])),
            "capacity": capacity_bands(group), "mechanism": mechanism(mean_result(group), group),
            "bands": band_rows(group)}


def write_files(out_dir: Path, results: list[ConfigResult], meta: dict) -> list[Path]:
    """sweep.csv (a row per point and seed), sweep.json (meta, configurations with bracket and mechanism, points),
    sweep.png, and with several seeds sweep.bands.csv (a row per configuration and rate: bands across seeds)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [r for res in results for r in _by_rate(res)]
    atomic_write_text(out_dir / "sweep.csv", _csv(rows, CSV_COLUMNS))
    groups = by_config(results)
    files = [out_dir / "sweep.csv", out_dir / "sweep.json", out_dir / "sweep.png"]
    if any(len(g) > 1 for g in groups):
        atomic_write_text(out_dir / "sweep.bands.csv", _csv([b for g in groups for b in band_rows(g)], BAND_COLUMNS))
        files.append(out_dir / "sweep.bands.csv")
    doc = {"schema": "sim-sweep", "version": 1, **meta, "configurations": [_config_doc(g) for g in groups],
           "trace_ids": sorted({r["trace_id"] for r in rows}),
           "points": [{k: r.get(k) for k in CSV_COLUMNS} for r in rows]}
    atomic_write_text(out_dir / "sweep.json", json.dumps(_json_safe(doc), indent=1) + "\n")
    plot(results, out_dir / "sweep.png")
    return files


def plot(results: list[ConfigResult], path: Path) -> None:
    """Served rate and queue wait p50 against arrival rate, one line per configuration; with several seeds the
    line is their mean and the shaded band their min to max, rate by rate."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (served, wait) = plt.subplots(1, 2, figsize=(13, 7))
    pools = sorted({res.config.pool_gib for res in results})
    batches = sorted({res.config.max_batch for res in results})
    colors = plt.get_cmap("viridis")([i / max(1, len(pools) - 1) * 0.9 for i in range(len(pools))])
    top = 0.0
    for group in by_config(results):
        config = group[0].config
        bands = band_rows(group)
        rate = [b["rate"] for b in bands]
        top = max(top, *rate)
        label = config.label if len(group) == 1 else \
            f"{config.label}: mean of {len(group)} seeds, shaded min-max across seeds"
        style = dict(color=colors[pools.index(config.pool_gib)], markersize=4, label=label,
                     marker="os^D"[batches.index(config.max_batch) % 4],
                     linestyle="-" if config.backend == "paged" else "--")
        for ax, k in ((served, "served_rate"), (wait, "queue_wait_p50")):
            ax.plot(rate, [b[f"{k}_mean"] for b in bands], **style)
            if len(group) > 1:
                ax.fill_between(rate, [b[f"{k}_min"] for b in bands], [b[f"{k}_max"] for b in bands],
                                color=style["color"], alpha=0.2, linewidth=0)
    served.plot([0, top], [0, top], color="grey", linewidth=0.8, linestyle=":", label="served = offered")
    served.set(xlabel="arrival rate (requests/s)", ylabel="served rate (requests/s)",
               title="served rate: leaves the diagonal at capacity")
    wait.set(xlabel="arrival rate (requests/s)", ylabel="queue wait p50 (s)",
             title="median queue wait: jumps past capacity")
    wait.set_yscale("symlog", linthresh=0.01)
    for ax in (served, wait):
        ax.grid(alpha=0.3)
    handles, labels = served.get_legend_handles_labels()
    rows = 1 + len(labels) // 4
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle("Where each configuration stops keeping up: the served rate flattens (or sags) and the queue wait "
                 "explodes")
    fig.tight_layout(rect=(0, 0.035 * rows, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
