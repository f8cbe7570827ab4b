"""`python -m validate mechanisms`: the graded report of servecap/validate/mechanisms.py's points (on-demand admission,
fused mixed steps, prefix caching): each point's blind prediction, the prediction of a re-calibrated table, and the
real runs (their mean and spread over repeats), with the targets met or missed.

Re-calibration is a calibration of the engine as it now is, or `calibrate --from-runs` (a fused step is priced
from its record by servecap/costs/recorded.fused_shape), whose table names the runs it was fitted on and those it held out, and the report says
for each point whether its runs were held out, so the re-calibrated figures of held-out points are a fair grade and
the others show the fit.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from servecap.sim import inputs
from servecap.traces.csvio import atomic_write_text
from servecap.traces.errors import InputError
from servecap.traces.metrics import summary

from .plan import predict
from .points import complete_runs, load_plan, run_dir

KEYS = ("served_rate", "ttft_p50", "ttft_p95", "tpot_p50")
SERVED_LIMIT = 0.03


def _mean(runs, key: str) -> tuple[float, float, float]:
    v = [summary(r, r.meta.get("trace", {}).get("rate"))[key] for r in runs]
    return float(np.mean(v)), float(min(v)), float(max(v))


def grade(out: Path, table_path: Path | None, recalibrated: Path | None = None, force: bool = False) -> Path:
    out = Path(out)
    dest = out / "mechanisms.md"
    if dest.exists() and not force:
        raise InputError("already holds a mechanisms report; pass --force to replace it", path=dest)
    plan, points = load_plan(out)
    table = inputs.load_table(table_path, allow_nonstationary=True)
    if table.table_id != plan["table"]["id"]:
        raise InputError(f"the plan was made from table {plan['table']['id']}, not {table.table_id}")
    bands = plan.get("intervals", {}).get("bands", {})
    again = None
    if recalibrated is not None:
        again = inputs.load_table(recalibrated, allow_nonstationary=True)
        fitted = {Path(p).resolve() for p in again.raw.get("correction", {}).get("fitted_runs", [])}
    lines = [f"# Mechanisms: blind predictions against the real engine ({out.name})", "",
             f"Plan from table {table.table_id}, made {plan['table']['created_at']}; predictions and "
             f"{plan.get('intervals', {}).get('level', '-')}% bands frozen in plan.json before any real run. "
             "Real: the mean of the repeats (min-max in brackets). Errors are (predicted - measured) / measured.", ""]
    if again is not None:
        how = "`calibrate --from-runs`" if again.raw.get("correction") else "a calibration"
        lines += [f"Re-calibrated: table {again.table_id} ({how}, {recalibrated}); `held out`: "
                  "none of the point's runs entered its fit.", ""]
    lines += ["| point | held out | served blind / re-cal / real (req/s) | TTFT p50 blind / re-cal / real (ms) | TTFT p50 band "
              "(ms) | TTFT p95 blind / real (ms) | TPOT p50 blind / real (ms) | other |", "|---|---|---|---|---|---|---|---|"]
    targets = {"served within 3%, blind": [], "served within 3%, re-calibrated": [],
               "served within 3%, re-calibrated, held-out points": [], "TTFT p50 inside the band (every repeat)": []}
    for p in points:
        runs = complete_runs(out, p)
        if not runs:
            continue
        blind = plan["predictions"][p.id]
        real = {k: _mean(runs, k) for k in KEYS}
        served = real["served_rate"][0]
        err = (blind["served_rate"] - served) / served
        targets["served within 3%, blind"].append((abs(err) <= SERVED_LIMIT, p.id, err))
        re, out_of_fit = None, None
        if again is not None:
            re = predict(again, p, out)
            out_of_fit = not any(run_dir(out, p, k).resolve() in fitted for k in range(1, p.repeats + 1))
            e = (re["served_rate"] - served) / served
            targets["served within 3%, re-calibrated"].append((abs(e) <= SERVED_LIMIT, p.id, e))
            if out_of_fit:
                targets["served within 3%, re-calibrated, held-out points"].append((abs(e) <= SERVED_LIMIT, p.id, e))
        band = bands.get(p.id, {}).get("ttft_p50")
        inside = band is not None and all(band["lo"] <= summary(r, r.meta.get("trace", {}).get("rate"))["ttft_p50"]
                                          <= band["hi"] for r in runs)
        if band is not None:
            targets["TTFT p50 inside the band (every repeat)"].append((inside, p.id, None))
        other = ""
        if "preemptions" in blind:
            got = [summary(r)["preemptions"] for r in runs]
            other = f"preemptions {blind['preemptions']} / {'-'.join(map(str, sorted(set(got))))}"
            if blind.get("prefix_hit_rate"):
                hit = [summary(r)["prefix_hit_rate"] for r in runs]
                other = f"hit rate {blind['prefix_hit_rate']:.1%} / {np.mean(hit):.1%}"

        def f(v, scale=1.0, d=1):
            return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v * scale:.{d}f}"

        def m(key, scale=1.0, d=1):
            mean, lo, hi = real[key]
            return f"{f(mean, scale, d)} ({f(lo, scale, d)}-{f(hi, scale, d)})" if len(runs) > 1 else f(mean, scale, d)

        held = "-" if out_of_fit is None else "yes" if out_of_fit else "no"
        lines.append(f"| {p.id} | {held} | {f(blind['served_rate'])} / {f(re and re['served_rate'])} / "
                     f"{m('served_rate')} | {f(blind['ttft_p50'], 1e3, 0)} / {f(re and re['ttft_p50'], 1e3, 0)} / "
                     f"{m('ttft_p50', 1e3, 0)} | {f(band and band['lo'], 1e3, 0)}-{f(band and band['hi'], 1e3, 0)}"
                     f"{'' if inside else ' (out)'} | {f(blind['ttft_p95'], 1e3, 0)} / {m('ttft_p95', 1e3, 0)} | "
                     f"{f(blind['tpot_p50'], 1e3, 2)} / {m('tpot_p50', 1e3, 2)} | {other} |")
    lines += ["", "## Targets", "", "| target | met | missed at |", "|---|---|---|"]
    for name, rows in targets.items():
        missed = [f"{i} ({e:+.1%})" if e is not None else i for ok, i, e in rows if not ok]
        lines.append(f"| {name} | {sum(ok for ok, _, _ in rows)} of {len(rows)} | {', '.join(missed) or '-'} |")
    atomic_write_text(dest, "\n".join(lines) + "\n")
    return dest
