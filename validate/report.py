"""The validation report: every point's prediction (made at plan time) beside the measured repeats, with errors,
the targets, the measured step costs against the cost model, and a figure. CPU only, from the records."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from costs.model import CostModel
from costs.shapes import PrefillShape
from sim import inputs
from traces.csvio import atomic_write_text
from traces.errors import InputError
from traces.metrics import capacity_bracket, closed_run, summary
from traces.records import read_run

from .points import ABS_FLOOR, Point, build_trace, complete_runs, load_plan, rel_error

FIGURES = ("served_rate", "queue_wait_p50", "queue_wait_p95", "ttft_p50", "ttft_p95", "tpot_p50",
           "group_size_p50", "group_size_p95", "group_size_max", "padding_waste_p50", "padding_waste_p95")


@dataclass
class Compared:
    point: Point
    rate: float | None
    sim: dict
    real: list[dict] = field(default_factory=list)  # one per repeat

    @property
    def measured(self) -> dict:
        return {k: statistics.median(r[k] for r in self.real) for k in self.real[0] if _number(self.real[0][k])}


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_error = rel_error


def compare(out: Path, table_path: Path | None) -> list[Compared]:
    """Every point with real records: the plan's own prediction beside the measured repeats."""
    plan, points = load_plan(out)
    table = inputs.load_table(table_path, 64)
    if table.table_id != plan["table"]["id"]:
        raise InputError(f"the plan was made from cost table {plan['table']['id']}, not {table.table_id}; grade it "
                         f"against its own table (--table)", path=Path(out) / "plan.json")
    missing = [p.id for p in points if not complete_runs(out, p)]
    if missing and len(missing) < len(points):
        import warnings
        warnings.warn(f"{len(missing)} point(s) have no complete real records yet: {', '.join(missing)}")
    results = []
    for p in points:
        runs = complete_runs(out, p)
        if not runs:
            continue
        trace = build_trace(p.trace, out)
        for r in runs:
            if r.meta["trace_id"] != trace.trace_id:
                raise InputError(f"point {p.id}: the real run replayed trace {r.meta['trace_id']}, "
                                 f"the plan's is {trace.trace_id}")
            if r.meta.get("plan_table_id", plan["table"]["id"]) != plan["table"]["id"]:
                raise InputError(f"point {p.id}: a real run was planned against cost table {r.meta['plan_table_id']}")
        rate = trace.meta.get("rate") or trace.offered_rate
        results.append(Compared(p, rate, plan["predictions"][p.id], [_scored(r, rate) for r in runs]))
    return results


def _scored(rec, rate) -> dict:
    s = summary(rec, rate)
    if rate is None:
        s.update(closed_run(rec))
    return s


def step_check(out: Path, table_path: Path | None) -> dict:
    """Measured step durations against the cost model at the same shapes, over every real run."""
    cost = CostModel(inputs.load_table(table_path, 64))
    ratios: dict[str, list[float]] = {"prefill": [], "decode paged": [], "decode padded": []}
    for d in sorted((out / "real").glob("*/run-*")):
        rec = read_run(d)
        s = rec.steps
        for row in s.itertuples():
            dur = row.end - row.start
            if row.kind == "prefill":
                if row.tokens == row.rows * row.padded_len:  # a padded group: its rows are known
                    ratios["prefill"].append(dur / cost.prefill(PrefillShape.padded(int(row.rows), int(row.padded_len))))
            else:
                pred = float(cost.decode(rec.meta["backend"], int(row.rows), int(row.kv_tokens), int(row.kv_max)))
                pred += cost.retire_s if row.retired else 0.0
                ratios[f"decode {rec.meta['backend']}"].append(dur / pred)
    return {k: {"n": len(v), "p10": float(np.percentile(v, 10)), "p50": float(np.median(v)),
                "p90": float(np.percentile(v, 90))} for k, v in ratios.items() if v}


def write_report(out: Path, table_path: Path | None) -> Path:
    import csv
    import io

    results = compare(out, table_path)
    if not results:
        raise InputError("no real records to compare yet; run `python -m sim validate real` on a GPU", path=out / "real")
    rows = []
    for c in results:
        m = c.measured
        row = {"point": c.point.id, "role": c.point.role, "backend": c.point.backend, "max_batch": c.point.max_batch,
               "pool_gib": c.point.pool_gib, "rate": c.rate, "repeats": len(c.real)}
        for k in FIGURES + (("wall_time_s",) if c.rate is None else ()):
            row[f"{k}_sim"], row[f"{k}_real"] = c.sim.get(k), m.get(k)
            row[f"{k}_err"] = _error(c.sim.get(k, math.nan), m.get(k, math.nan), k)
        if len(c.real) > 1:
            row["served_rate_spread"] = (max(r["served_rate"] for r in c.real) - min(r["served_rate"] for r in c.real)) \
                / m["served_rate"]
        if c.rate is not None:
            row["stable_sim"], row["stable_real"] = c.sim["stable"], all(r["stable"] for r in c.real)
        rows.append(row)
    cols = list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    w = csv.DictWriter(buf, cols)
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(out / "points.csv", buf.getvalue())
    steps = step_check(out, table_path)
    table = inputs.load_table(table_path, 64)
    md = _markdown(results, rows, steps, out, table)
    atomic_write_text(out / "report.md", md)
    _plot(results, out / "validation.png")
    return out / "report.md"


def _curve(results: list[Compared], roles=("below", "near", "past")) -> list[Compared]:
    return sorted((c for c in results if c.point.role in roles), key=lambda c: c.rate)


def headline(results: list[Compared]) -> dict:
    """The issue's targets, measured: served-rate error, stable-point wait error, capacity bracket, sag, closed."""
    arrivals = [c for c in results if c.rate is not None]
    curve = _curve(results)
    served_err = max(abs(_error(c.sim["served_rate"], c.measured["served_rate"], "served_rate")) for c in arrivals)
    waits = [(c.point.id, c.sim["queue_wait_p50"], c.measured["queue_wait_p50"]) for c in arrivals
             if all(r["stable"] for r in c.real)]
    wait_ok = all(abs(p - m) <= max(0.10 * abs(m), 0.020) for _, p, m in waits)
    br_sim = capacity_bracket((c.rate, c.sim["stable"]) for c in curve)
    br_real = capacity_bracket((c.rate, all(r["stable"] for r in c.real)) for c in curve)

    def drop(vals: list[float]) -> float:
        return max(vals) - vals[-1]
    sag_sim = drop([c.sim["served_rate"] for c in curve])
    sag_real = drop([c.measured["served_rate"] for c in curve])
    closed = [c for c in results if c.point.role == "closed"]
    return {
        "served_rate_max_abs_err": served_err,
        "stable_wait_p50_within_max_10pct_20ms": wait_ok,
        "stable_wait_points": [(i, round(p, 4), round(m, 4)) for i, p, m in waits],
        "capacity_bracket_sim": br_sim, "capacity_bracket_real": br_real, "capacity_bracket_equal": br_sim == br_real,
        "sag_sim": sag_sim, "sag_real": sag_real,
        "sag_within_25pct": abs(sag_sim - sag_real) <= 0.25 * sag_real if sag_real > 0 else None,
        "closed_wall_max_abs_err": max((abs(_error(c.sim["wall_time_s"], c.measured["wall_time_s"], "wall")) for c in closed),
                                       default=math.nan),
        "ttft_p50_max_abs_err": max(abs(_error(c.sim["ttft_p50"], c.measured["ttft_p50"], "ttft_p50")) for c in results),
    }


def _fmt(v, spec=".3g") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return format(v, spec) if _number(v) else str(v)


def _markdown(results: list[Compared], rows: list[dict], steps: dict, out: Path, table) -> str:
    h = headline(results)
    plan, _ = load_plan(out)
    first = read_run(next(iter(sorted((out / "real").glob("*/run-1")))))
    dev, sw = first.meta["device"], first.meta["software"]
    lines = ["# Validation: simulator against the real engine", "",
             f"Real runs on {dev['name']} ({dev.get('memory_gib')} GiB; torch {sw.get('torch')}, triton {sw.get('triton')}); "
             f"predictions from {table.summary()}; points chosen from the "
             f"sweep of table {plan['table']}. {len(results)} points, "
             f"{sum(len(c.real) for c in results)} real runs. Errors are (predicted - measured) / measured; "
             f"queue wait p50 errors use a {ABS_FLOOR['queue_wait_p50'] * 1e3:.0f} ms floor on the denominator.", "",
             "## Targets", "",
             f"- served rate error at every point: max {h['served_rate_max_abs_err']:.1%} (target <= 3%)",
             f"- queue wait p50 at stable points within max(10%, 20 ms): {_fmt(h['stable_wait_p50_within_max_10pct_20ms'])} "
             f"({', '.join(f'{i}: {p:.3f} vs {m:.3f} s' for i, p, m in h['stable_wait_points'])})",
             f"- capacity bracket: simulated {h['capacity_bracket_sim']}, measured {h['capacity_bracket_real']}: "
             f"{'equal' if h['capacity_bracket_equal'] else 'DIFFERENT'}",
             f"- sag past capacity (peak served rate minus served rate at the highest rate): simulated "
             f"{h['sag_sim']:.2f}, measured {h['sag_real']:.2f} req/s; within 25%: {_fmt(h['sag_within_25pct'])}",
             f"- closed controls wall time: max error {h['closed_wall_max_abs_err']:.1%} (target <= 5%); "
             f"TTFT p50 everywhere: max error {h['ttft_p50_max_abs_err']:.1%} (target <= 10%)", "",
             "## Points (predicted / measured, error)", ""]
    cols = ("served_rate", "queue_wait_p50", "queue_wait_p95", "ttft_p50", "ttft_p95", "tpot_p50", "group_size_p50",
            "group_size_p95", "group_size_max", "padding_waste_p50", "padding_waste_p95")
    lines.append("| point | rate | " + " | ".join(cols) + " | stable sim/real | repeats (spread) |")
    lines.append("|" + "---|" * (len(cols) + 4))
    for r in rows:
        cells = [f"{_fmt(r[f'{k}_sim'])} / {_fmt(r[f'{k}_real'])} ({_fmt(r[f'{k}_err'], '+.0%')})" for k in cols]
        stable = f"{_fmt(r.get('stable_sim'))}/{_fmt(r.get('stable_real'))}" if "stable_sim" in r else "closed"
        spread = f"{r['repeats']} ({r['served_rate_spread']:.1%})" if "served_rate_spread" in r else str(r["repeats"])
        lines.append(f"| {r['point']} | {_fmt(r['rate'])} | " + " | ".join(cells) + f" | {stable} | {spread} |")
    lines += ["", "## Closed controls (median of the recorded runs after warm-up)", "",
              "| point | wall s sim / real (error) | TTFT p50 s sim / real (error) |", "|---|---|---|"]
    for r in rows:
        if r["role"] == "closed":
            lines.append(f"| {r['point']} | {_fmt(r['wall_time_s_sim'])} / {_fmt(r['wall_time_s_real'])} "
                         f"({_fmt(r['wall_time_s_err'], '+.1%')}) | {_fmt(r['ttft_p50_sim'])} / {_fmt(r['ttft_p50_real'])} "
                         f"({_fmt(r['ttft_p50_err'], '+.1%')}) |")
    lines += ["", "## Step costs: measured step durations over the cost model's prediction at the same shape", "",
              "| steps | n | p10 | p50 | p90 |", "|---|---|---|---|---|"]
    lines += [f"| {k} | {v['n']} | {v['p10']:.3f} | {v['p50']:.3f} | {v['p90']:.3f} |" for k, v in steps.items()]
    lines += ["", "![validation](validation.png)", ""]
    return "\n".join(lines)


def _plot(results: list[Compared], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = _curve(results)
    fig, ax = plt.subplots(1, 3, figsize=(16, 4.6))
    rates = [c.rate for c in curve]
    for key, a, label in (("served_rate", ax[0], "served rate (req/s)"), ("queue_wait_p50", ax[1], "queue wait p50 (s)")):
        real = [c.measured[key] for c in curve]
        spread = [[c.measured[key] - min(r[key] for r in c.real) for c in curve],
                  [max(r[key] for r in c.real) - c.measured[key] for c in curve]]
        a.errorbar(rates, real, yerr=spread, fmt="o-", label="real engine (H200)", capsize=3)
        a.plot(rates, [c.sim[key] for c in curve], "s--", label="simulator")
        a.set_xlabel("arrival rate (req/s)")
        a.set_ylabel(label)
        a.legend()
    ax[0].plot(rates, rates, ":", color="grey", label="served = offered")
    ax[0].set_title("Served rate: the sim tracks the engine through capacity and the sag")
    ax[1].set_yscale("symlog", linthresh=0.01)
    ax[1].set_title("Queue wait p50 against arrival rate")
    names = [c.point.id for c in results]
    errs = [_error(c.sim["served_rate"], c.measured["served_rate"], "served_rate") * 100 for c in results]
    ax[2].barh(names, errs, color=["tab:red" if abs(e) > 3 else "tab:green" for e in errs])
    ax[2].axvline(-3, ls=":", color="grey")
    ax[2].axvline(3, ls=":", color="grey")
    ax[2].set_xlabel("served-rate error (%)")
    ax[2].set_title("Every point: served-rate error (target within 3%)")
    ax[2].tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
