"""The validation report: every point's prediction, made at plan time from the frozen table, beside the measured
repeats; for the prefill policies also the blind prediction, made before the engine had them; the targets met and
missed; the measured step costs against the model; whether the table and each run came from the same GPU; which
differences exceed the sampling spread of the trace; and a figure. CPU only, from the records, as
servecap/validate/comparison.py compares them (its protocol checks refuse a prediction that could not have been blind).
"""
from __future__ import annotations

import csv
import io
import math
from pathlib import Path

import numpy as np

from servecap.costs.model import CostModel
from servecap.costs.recorded import contextual, priced_steps
from servecap.sim import inputs
from servecap.traces.csvio import atomic_write_text
from servecap.traces.errors import InputError
from servecap.traces.metrics import capacity_bracket

from .comparison import Compared, _num, _number, compare
from .coverage import bands_for, coverage, markdown
from .points import ABS_FLOOR, complete_runs

KEYS = ("served_rate", "queue_wait_p50", "queue_wait_p95", "ttft_p50", "ttft_p95", "tpot_p50", "group_size_p95",
        "padding_waste_p95")
TARGETS = {"served": 0.03, "ttft_p50": 0.10, "closed_wall": 0.05, "blind": 0.10, "recalibrated": 0.03, "gap": 0.20,
           "sag": 0.25}


def beyond_spread(c: Compared, key: str) -> bool | None:
    """Whether predicted and measured differ by more than twice the trace's sampling spread."""
    if c.spread is None or key not in c.spread:
        return None
    return abs(_num(c.sim.get(key)) - _num(c.measured.get(key))) > 2 * c.spread[key]


def step_check(results: list[Compared], out: Path, table) -> dict:
    """Measured step time (servecap/costs/recorded.held_s) over the cost model's price at the same shape, with no
    serving context, by kind (prefill per policy, decode per backend), over every real run."""
    cost = CostModel(table)
    ratios: dict[str, list[float]] = {}
    for c in results:
        for rec in complete_runs(out, c.point):  # as compare's measurements: an interrupted repeat is not one
            s = priced_steps(rec, cost)
            ratio = s.real_s / contextual(s, None)
            for key, r in ratio.groupby(s.kind.str.replace(r"^(decode \S+) .*$", r"\1", regex=True)):
                ratios.setdefault(key, []).extend(r.tolist())
    return {k: {"n": len(v), "p10": float(np.percentile(v, 10)), "p50": float(np.median(v)),
                "p90": float(np.percentile(v, 90))} for k, v in ratios.items()}


def targets(results: list[Compared]) -> list[dict]:
    """Every target of the validation, measured: one row each, met or missed."""
    def by(*roles):
        return [c for c in results if c.point.role in roles]

    def worst(cs, key, pred=None):
        errs = [(abs(c.err(key, pred(c) if pred else None)), c.point.id) for c in cs
                if (pred is None or pred(c) is not None) and math.isfinite(c.err(key, pred(c) if pred else None))]
        return max(errs) if errs else (math.nan, "-")

    rows = []

    def add(name, cs, key, limit, pred=None, note=""):
        e, pid = worst(cs, key, pred)
        ok = [abs(c.err(key, pred(c) if pred else None)) <= limit for c in cs if (pred is None or pred(c) is not None)]
        rows.append({"target": name, "limit": limit, "worst": e, "worst_point": pid, "met": sum(ok), "of": len(ok),
                     "note": note})

    arrivals = [c for c in results if c.rate is not None]
    seeded = by("below", "near", "past", "small-pool")
    add("served rate, seeded points", seeded, "served_rate", TARGETS["served"])
    add("served rate, public traces (first pass of a fresh engine)", by("public"), "served_rate", TARGETS["served"])
    add("TTFT p50, public traces", by("public"), "ttft_p50", TARGETS["ttft_p50"])
    add("TTFT p50, seeded points", seeded, "ttft_p50", TARGETS["ttft_p50"])
    add("closed controls wall time", by("closed"), "wall_time_s", TARGETS["closed_wall"])
    add("fleet of two: served rate", by("fleet"), "served_rate", TARGETS["served"])
    stable = [c for c in arrivals if all(r["stable"] for r in c.real) and c.point.role not in ("sag", "fleet")]
    rows.append(queue_wait_target("queue wait p50 at stable points", stable))
    rows.append(queue_wait_target("fleet: queue wait p50 at stable points",
                                  [c for c in by("fleet") if all(r["stable"] for r in c.real)]))
    policy = [c for c in by("policy") if str(c.point.serving.prefill) != "padded"]
    add("policies: blind prediction, served rate", [c for c in policy if c.rate], "served_rate", TARGETS["blind"],
        lambda c: c.blind)
    add("policies: blind prediction, closed wall time", [c for c in policy if not c.rate], "wall_time_s",
        TARGETS["blind"], lambda c: c.blind)
    add("policies: re-calibrated prediction, served rate", [c for c in policy if c.rate], "served_rate",
        TARGETS["recalibrated"])
    add("policies: re-calibrated prediction, closed wall time", [c for c in policy if not c.rate], "wall_time_s",
        TARGETS["recalibrated"])
    add("policies: largest incumbent gap (re-calibrated)", by("policy"), "gap_max", TARGETS["gap"])
    add("policies: largest incumbent gap (blind)", by("policy"), "gap_max", TARGETS["gap"], lambda c: c.blind)
    curve = sorted(by("below", "near", "past"), key=lambda c: c.rate)
    if curve:
        br_sim = capacity_bracket((c.rate, c.sim["stable"]) for c in curve)
        br_real = capacity_bracket((c.rate, all(r["stable"] for r in c.real)) for c in curve)
        rows.append({"target": "capacity bracket, seeded curve", "limit": None, "worst": None,
                     "worst_point": f"sim {br_sim}, real {br_real}", "met": int(br_sim == br_real), "of": 1, "note": ""})
    for name, cs in _sag_groups(results).items():
        s_sim, s_real = _sag([c.sim["served_rate"] for c in cs]), _sag([c.measured["served_rate"] for c in cs])
        rows.append({"target": f"sag {name}: predicted within 25% of measured", "limit": TARGETS["sag"],
                     "worst": abs(s_sim - s_real) / s_real if s_real > 0 else math.nan,
                     "worst_point": f"sim {s_sim:.1%}, real {s_real:.1%}",
                     "met": int(s_real > 0 and abs(s_sim - s_real) <= TARGETS["sag"] * s_real), "of": 1, "note": ""})
    return rows


def queue_wait_target(name: str, cs: list[Compared]) -> dict:
    """Queue wait p50 within max(10%, the absolute floor). The floor is what judges waits of a few ms, so the worst
    miss is said in ms, with the relative errors beside it: a percentage of the floor would read as a relative
    error it is not."""
    floor = ABS_FLOOR["queue_wait_p50"]
    diffs = [(_num(c.sim["queue_wait_p50"]) - c.measured["queue_wait_p50"], c) for c in cs]
    ok = [abs(d) <= max(0.1 * c.measured["queue_wait_p50"], floor) for d, c in diffs]
    where = "-"
    if diffs:
        d, c = max(diffs, key=lambda dc: abs(dc[0]))
        rel = [d / c.measured["queue_wait_p50"] for d, c in diffs if c.measured["queue_wait_p50"] > 0]
        where = (f"{d * 1e3:+.2f} ms at {c.point.id} (measured {c.measured['queue_wait_p50'] * 1e3:.2f} ms); "
                 f"relative errors {min(rel):+.1%} to {max(rel):+.1%}" if rel else f"{d * 1e3:+.2f} ms at {c.point.id}")
    return {"target": f"{name}, within max(10%, {floor * 1e3:.0f} ms)", "limit": None, "worst": None,
            "worst_point": where, "met": sum(ok), "of": len(ok), "note": ""}


def _sag_groups(results: list[Compared]) -> dict[str, list[Compared]]:
    groups: dict[str, list[Compared]] = {}
    for c in sorted((c for c in results if c.point.role == "sag"), key=lambda c: c.rate):
        groups.setdefault(c.point.id.rsplit("-rate-", 1)[0].removeprefix("sag-"), []).append(c)
    return groups


def _sag(served: list[float]) -> float:
    """The fall from the peak served rate to the served rate at the highest rate, over the peak."""
    return (max(served) - served[-1]) / max(served)


MS_KEYS = ("queue_wait_p50", "ttft_p50", "ttft_p95", "gap_max")  # latencies: printed in ms (records hold seconds)


def _fmt(v, spec=".3g") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return format(v, spec) if _number(v) else str(v)


def write_report(out: Path, table_path: Path | None, force: bool = False, allow_nonstationary: bool = False) -> Path:
    out = Path(out)
    if (out / "report.md").exists() and not force:
        raise InputError("already holds a report; pass --force to write it again from the records", path=out / "report.md")
    plan, results = compare(out, table_path, allow_nonstationary)
    if not results:
        raise InputError("no real records to compare yet; run `python -m validate real` on a GPU", path=out / "real")
    table = inputs.load_table(table_path, allow_nonstationary=allow_nonstationary)
    rows = []
    for c in results:
        m = c.measured
        row = {"point": c.point.id, "role": c.point.role, "prefill": str(c.point.serving.prefill), "backend": c.point.serving.backend,
               "max_batch": c.point.serving.max_batch, "pool_gib": c.point.serving.pool.gib, "rate": c.rate, "repeats": len(c.real),
               "gpu": ",".join(sorted({r["device"].get("uuid") or "?" for r in c.meta})),
               "same_gpu_as_table": all(r["device"].get("uuid") == table.gpu_uuid for r in c.meta),
               "fresh_engine": c.point.fresh}
        for k in KEYS + ("wall_time_s", "gap_max"):
            if k not in m and k not in c.sim:
                continue
            row[f"{k}_sim"], row[f"{k}_real"], row[f"{k}_err"] = c.sim.get(k), m.get(k), c.err(k)
            if c.blind is not None and k in c.blind:
                row[f"{k}_blind"], row[f"{k}_blind_err"] = c.blind[k], c.err(k, c.blind)
        if c.spread:
            row["served_rate_seed_sd"] = c.spread["served_rate"]
            row["served_rate_beyond_2sd"] = beyond_spread(c, "served_rate")
        if c.rate is not None:
            row["stable_sim"], row["stable_real"] = c.sim.get("stable"), all(r["stable"] for r in c.real)
        rows.append(row)
    cols = list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    w = csv.DictWriter(buf, cols)
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(out / "points.csv", buf.getvalue())
    steps = step_check(results, out, table)
    text = _markdown(plan, results, rows, steps, table)
    if "intervals" in plan:  # frozen with the plan: graded blind here (validate coverage grades any plan)
        bands, what = bands_for(plan, results, table, None, out)
        text += "\n" + "\n".join(markdown(coverage(results, bands), what))
    atomic_write_text(out / "report.md", text)
    _plot(results, out / "validation.png")
    return out / "report.md"


def _markdown(plan: dict, results: list[Compared], rows: list[dict], steps: dict, table) -> str:
    devices = sorted({(r["device"]["name"], r["device"].get("uuid")) for c in results for r in c.meta})
    lines = ["# Validation: the simulator's predictions against the real engine", "",
             f"Predictions made at plan time from {table.summary()}, created {table.created_at}; {len(results)} points, "
             f"{sum(len(c.real) for c in results)} real runs on " + ", ".join(f"{n} ({u})" for n, u in devices) + ". "
             f"Every run was made after the table and planned against it (checked). Errors are (predicted - measured) / "
             f"measured; the points' queue wait p50 errors use a {ABS_FLOOR['queue_wait_p50'] * 1e3:.0f} ms floor on the "
             "denominator (the targets say the worst in ms). "
             "Same GPU: whether a run's GPU UUID is the table's.", "", "## Targets", "",
             "| target | met | worst error | where | limit |", "|---|---|---|---|---|"]
    graded = targets(results)
    for t in (t for t in graded if t["of"]):
        lines.append(f"| {t['target']} | {t['met']} of {t['of']} | {_fmt(t['worst'], '.1%')} | {t['worst_point']} | "
                     f"{_fmt(t['limit'], '.0%')} |")
    if any(not t["of"] for t in graded):
        lines += ["", "Not graded here (the plan has no such points): " +
                  "; ".join(t["target"] for t in graded if not t["of"]) + "."]
    lines += ["", "## Points (predicted / measured, error; blind prediction where there is one)", "",
              "| point | rate (req/s) | served (req/s) | queue p50 (ms) | TTFT p50 (ms) | TTFT p95 (ms) | wall (s) | "
              "largest gap (ms) | stable servecap/sim/real | seed sd of served | same GPU |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        def cell(k: str) -> str:
            if f"{k}_sim" not in r:
                return "-"
            def v(x) -> str:
                if k not in MS_KEYS or not _number(x):
                    return _fmt(x)
                return _fmt(x * 1e3, ".0f" if abs(x) >= 0.1 else ".3g")
            s = f"{v(r[f'{k}_sim'])} / {v(r[f'{k}_real'])} ({_err_cell(k, r[f'{k}_sim'], r[f'{k}_real'], r[f'{k}_err'])})"
            if f"{k}_blind" in r:
                s += f"; blind {v(r[f'{k}_blind'])} ({_fmt(r[f'{k}_blind_err'], '+.1%')})"
            return s
        stable = f"{_fmt(r.get('stable_sim'))}/{_fmt(r.get('stable_real'))}" if "stable_real" in r else "closed"
        sd = "-" if "served_rate_seed_sd" not in r else \
            f"{r['served_rate_seed_sd']:.2f}{' (beyond 2 sd)' if r['served_rate_beyond_2sd'] else ''}"
        lines.append(f"| {r['point']} | {_fmt(r['rate'])} | {cell('served_rate')} | {cell('queue_wait_p50')} | "
                     f"{cell('ttft_p50')} | {cell('ttft_p95')} | {cell('wall_time_s')} | {cell('gap_max')} | {stable} | "
                     f"{sd} | {_fmt(r['same_gpu_as_table'])} |")
    lines += ["", "## Step costs: measured over the cost model at the same shape (every real step)", "",
              "| steps | n | p10 | p50 | p90 |", "|---|---|---|---|---|"]
    lines += [f"| {k} | {v['n']} | {v['p10']:.3f} | {v['p50']:.3f} | {v['p90']:.3f} |" for k, v in steps.items()]
    lines += ["", "![validation](validation.png)", ""]
    return "\n".join(lines)


def _err_cell(key: str, pred, meas, err) -> str:
    """A relative error; one judged against an absolute floor (a wait of a few ms) as the difference in ms."""
    if key in ABS_FLOOR and _number(pred) and _number(meas) and abs(meas) < ABS_FLOOR[key]:
        return f"{(pred - meas) * 1e3:+.2f} ms"
    return _fmt(err, '+.1%')


def _plot(results: list[Compared], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    device = results[0].meta[0]["device"]["name"]
    curve = sorted((c for c in results if c.point.role in ("below", "near", "past")), key=lambda c: c.rate)
    fig, ax = plt.subplots(1, 3, figsize=(17, 4.8))
    for name, cs in [("seeded trace", curve)] + [(f"{p} prefill", sorted(
            (c for c in results if c.point.role == "policy" and str(c.point.serving.prefill) == p and c.rate),
            key=lambda c: c.rate)) for p in dict.fromkeys(str(c.point.serving.prefill) for c in results if c.point.role == "policy")]:
        if not cs:
            continue
        line, = ax[0].plot([c.rate for c in cs], [c.measured["served_rate"] for c in cs], "o-",
                           label=f"{name}: {device}")
        ax[0].plot([c.rate for c in cs], [c.sim["served_rate"] for c in cs], "s--", color=line.get_color(),
                   mfc="none", label=f"{name}: simulated")
    # The other arrival points (public traces, mechanisms) are each their own trace: points, not a curve.
    others = [c for c in results if c.rate and c.point.role not in ("below", "near", "past", "policy")]
    for p in dict.fromkeys(str(c.point.serving.prefill) for c in others):
        cs = [c for c in others if str(c.point.serving.prefill) == p]
        dot = ax[0].scatter([c.rate for c in cs], [c.measured["served_rate"] for c in cs], marker="o",
                            label=f"{p}, a trace a point: {device}")
        ax[0].scatter([c.rate for c in cs], [c.sim["served_rate"] for c in cs], marker="s", facecolors="none",
                      edgecolors=dot.get_facecolor(), label=f"{p}, a trace a point: simulated")
    top = max(c.rate for c in results if c.rate)
    ax[0].plot([0, top], [0, top], ":", color="grey", label="served = offered")
    ax[0].set(xlabel="arrival rate (req/s)", ylabel="served rate (req/s)",
              title="Served rate against arrival rate, measured and simulated")
    ax[0].legend(fontsize=7)
    arrivals = [c for c in results if c.rate]
    ax[1].loglog([max(c.measured["queue_wait_p50"] * 1e3, 0.1) for c in arrivals],  # ms, floored at 0.1 ms
                 [max(_num(c.sim["queue_wait_p50"]) * 1e3, 0.1) for c in arrivals], "o")
    ax[1].plot([0.1, 1e5], [0.1, 1e5], ":", color="grey")
    ax[1].set(xlabel=f"measured queue wait p50 (ms, {device})", ylabel="simulated (ms)",
              title="Queue wait p50 at every arrival point")
    names = [c.point.id for c in results]
    errs = [100 * c.err("served_rate") for c in results]
    ax[2].barh(names, errs, color=["tab:red" if abs(e) > 3 else "tab:green" for e in errs])
    for x in (-3, 3):
        ax[2].axvline(x, ls=":", color="grey")
    ax[2].set(xlabel="served-rate error (%)", title="Served-rate error per point (3% marked)")
    ax[2].tick_params(axis="y", labelsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
