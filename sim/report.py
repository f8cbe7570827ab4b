"""What a sweep says: a table and a capacity bracket per configuration, the mechanism behind each, and the
files (sweep.csv, sweep.json, sweep.png)."""
from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

from traces.csvio import atomic_write_text
from traces.metrics import GOODPUT_FRACTION, slo_keys
from traces.slo import SLO, describe

from .sweep import ConfigResult

SAG = 0.95  # past capacity, a served rate below this fraction of the peak is a sag worth explaining
MEMORY_BOUND = 0.10  # the head blocked by blocks this much of step time (with rows free) is memory-bound

CSV_COLUMNS = ("backend", "max_batch", "pool_gib", "replicas", "router", "pool_blocks", "rate", "trace_id", "n",
               "served_rate", "expected_rate", "stable", "served_ok", "trend_rise_s", "queue_wait_p50",
               "queue_wait_p95", "ttft_p50", "ttft_p95", "tpot_p50", "group_size_p50", "group_size_p95", "group_size_max",
               "padding_waste_p50", "padding_waste_p95", "mean_running_rows", "rows_while_queued",
               "head_blocked_frac", "sim_events", "sim_wall_s")
# (heading, row key, format) for the printed table
_TABLE = (("rate", "rate", "{:.3g}"), ("served", "served_rate", "{:.2f}"), ("wait p50", "queue_wait_p50", "{:.2f}"),
          ("p95", "queue_wait_p95", "{:.2f}"), ("TTFT p50", "ttft_p50", "{:.2f}"), ("p95", "ttft_p95", "{:.2f}"),
          ("TPOT p50", "tpot_p50", "{:.3f}"), ("group p50/p95/max", None, None), ("waste p50/p95", None, None),
          ("rows", "mean_running_rows", "{:.1f}"), ("blocked", "head_blocked_frac", "{:.0%}"),
          ("stable", "stable", None))
_SLO_TABLE = (("goodput", "goodput", "{:.2f}"), ("SLOs", "slo_ok", None))


def _cell(row: dict, key: str | None, fmt: str | None, heading: str) -> str:
    if heading.startswith("group"):
        return "/".join(f"{row[k]:.0f}" for k in ("group_size_p50", "group_size_p95", "group_size_max"))
    if heading.startswith("waste"):
        return "/".join(f"{row[k]:.2f}" for k in ("padding_waste_p50", "padding_waste_p95"))
    value = row[key]
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt.format(value)


def table(res: ConfigResult, slos: tuple[SLO, ...] = ()) -> str:
    """The configuration's points, one line per rate (times in seconds, rates in requests per second)."""
    cols = _TABLE + (_SLO_TABLE if slos else ())
    cells = [[h for h, _, _ in cols]] + [[_cell(r, k, f, h) for h, k, f in cols] for r in _by_rate(res)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells)


def _by_rate(res: ConfigResult) -> list[dict]:
    return sorted(res.rows, key=lambda r: r["rate"])


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


def mechanism(res: ConfigResult) -> list[str]:
    """Why the configuration behaves as it does past capacity: the sag (or its absence) and the pool."""
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
    if last["served_rate"] < SAG * peak["served_rate"]:
        lines = [f"past capacity the served rate sags from {peak['served_rate']:.2f} req/s (offered "
                 f"{peak['rate']:.3g}) to {last['served_rate']:.2f} (offered {last['rate']:.3g}): the queue deepens "
                 f"(wait p50 {first['queue_wait_p50']:.1f} -> {last['queue_wait_p50']:.1f} s), {groups}, so each "
                 f"prefill spends more of the engine's time on padding"]
    else:
        lines = [f"past capacity the served rate holds near {last['served_rate']:.2f} req/s (peak "
                 f"{peak['served_rate']:.2f}), no sag: {groups}"]
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


def report(results: list[ConfigResult], slos: tuple[SLO, ...] = ()) -> str:
    parts = [slo_definition(slos)] if slos else []
    for res in results:
        estimate = f" (saturated estimate {res.estimate:.3g} req/s)" if res.estimate else ""
        parts.append(f"\n{res.config.label} ({res.pool_blocks} blocks): {capacity(res, slos)}{estimate}")
        parts.append(table(res, slos))
        parts.extend(f"  - {line}" for line in mechanism(res))
    return "\n".join(parts)


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_files(out_dir: Path, results: list[ConfigResult], meta: dict, slos: tuple[SLO, ...] = ()) -> list[Path]:
    """sweep.csv (a row per point), sweep.json (meta, configurations with bracket and mechanism, points), sweep.png.
    With SLOs, the points gain their SLO scores and the configurations their bracket by the SLOs."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [r for res in results for r in _by_rate(res)]
    columns = CSV_COLUMNS + tuple(slo_keys(slos))
    buf = io.StringIO()
    w = csv.DictWriter(buf, columns, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(out_dir / "sweep.csv", buf.getvalue())
    configs = [{"label": res.config.label, "backend": res.config.backend, "max_batch": res.config.max_batch,
                "pool_gib": res.config.pool_gib, "replicas": res.config.replicas, "router": res.config.router,
                "pool_blocks": res.pool_blocks, "rates": res.rates,
                "capacity_estimate": res.estimate, "capacity_lo": res.bracket[0], "capacity_hi": res.bracket[1],
                **({"slo_capacity_lo": res.slo_bracket[0], "slo_capacity_hi": res.slo_bracket[1]} if slos else {}),
                "capacity_by": "slos" if slos else "stability",
                "capacity": capacity(res, slos), "mechanism": mechanism(res)} for res in results]
    doc = {"schema": "sim-sweep", "version": 1, **meta, "configurations": configs,
           "trace_ids": sorted({r["trace_id"] for r in rows}),
           "points": [{k: r.get(k) for k in columns} for r in rows]}
    atomic_write_text(out_dir / "sweep.json", json.dumps(_json_safe(doc), indent=1) + "\n")
    plot(results, out_dir / "sweep.png")
    return [out_dir / "sweep.csv", out_dir / "sweep.json", out_dir / "sweep.png"]


def plot(results: list[ConfigResult], path: Path) -> None:
    """Served rate and queue wait p50 against arrival rate, one line per configuration."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (served, wait) = plt.subplots(1, 2, figsize=(13, 7))
    pools = sorted({res.config.pool_gib for res in results})
    batches = sorted({res.config.max_batch for res in results})
    colors = plt.get_cmap("viridis")([i / max(1, len(pools) - 1) * 0.9 for i in range(len(pools))])
    top = 0.0
    for res in results:
        rows = _by_rate(res)
        rate = [r["rate"] for r in rows]
        top = max(top, *rate)
        style = dict(color=colors[pools.index(res.config.pool_gib)], markersize=4, label=res.config.label,
                     marker="os^D"[batches.index(res.config.max_batch) % 4],
                     linestyle="-" if res.config.backend == "paged" else "--")
        served.plot(rate, [r["served_rate"] for r in rows], **style)
        wait.plot(rate, [r["queue_wait_p50"] for r in rows], **style)
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
