"""`python -m validate mechanisms`: the graded report of validate/mechanisms.py's points (on-demand admission,
fused mixed steps, prefix caching): each point's blind prediction, a re-calibrated one where the mechanism has a
step kind of its own, and the real runs (their mean and spread over repeats), with the targets met or missed.

Re-calibration (fused steps): a fused step's sequences are not in its record (steps keep totals), so its cost is
fitted at the level of the step kind, as calibrate --from-runs fits serving context: the summed real time of the
prefill and fused steps of the closed mixed controls over the simulator's for the same steps (a closed run is
scheduled the same on both clocks) is one factor per fused policy, written into the table's correction as the
kind `prefill mixed`; the rate points, which did not enter the fit, are then predicted again with that table.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from costs.model import CostModel
from costs.table import load_cost_table, save_cost_table
from sim import inputs
from sim.simulator import simulate
from traces.csvio import atomic_write_text
from traces.errors import InputError
from traces.metrics import summary

from .plan import point_config, predict
from .points import build_trace, complete_runs, load_plan

KEYS = ("served_rate", "ttft_p50", "ttft_p95", "tpot_p50")
SERVED_LIMIT = 0.03


def _mean(runs, key: str) -> tuple[float, float, float]:
    v = [summary(r, r.meta.get("trace", {}).get("rate"))[key] for r in runs]
    return float(np.mean(v)), float(min(v)), float(max(v))


def fused_factor(plan: dict, points, out: Path, table) -> tuple[float, int] | None:
    """real / simulated summed prefill and fused step time of the closed mixed controls (module docstring)."""
    real = sim = 0.0
    n = 0
    cost = CostModel(table)
    for p in points:
        if p.trace["kind"] != "closed-mixed" or not p.serving.prefill.fuses:
            continue
        rec = simulate(build_trace(p.trace, out), cost, point_config(p)).record
        s = rec.steps[rec.steps.kind != "decode"]
        for r in complete_runs(out, p):
            t = r.steps[r.steps.kind != "decode"]
            if len(t) != len(s):
                raise InputError(f"{p.id}: the real run has {len(t)} prefill steps, the simulator {len(s)}")
            real += float((t.end - t.start).sum())
            sim += float((s.end - s.start).sum())
            n += len(t)
    return (real / sim, n) if sim else None


def recalibrated_table(table, factor: float, n: int, path: Path):
    """The table with the fused steps' factor in its correction, saved at `path` (its own id)."""
    raw = json.loads(json.dumps(table.raw))
    corr = raw.setdefault("correction", {"factors": {}})
    corr["factors"]["prefill mixed"] = {"factor": factor, "n": n}
    raw["recalibrated_from"] = {"table_id": table.table_id, "by": "validate mechanisms (closed mixed controls)"}
    save_cost_table(raw, path)
    return load_cost_table(path, allow_nonstationary=True)


def grade(out: Path, table_path: Path | None, force: bool = False) -> Path:
    out = Path(out)
    dest = out / "mechanisms.md"
    if dest.exists() and not force:
        raise InputError("already holds a mechanisms report; pass --force to replace it", path=dest)
    plan, points = load_plan(out)
    table = inputs.load_table(table_path, allow_nonstationary=True)
    if table.table_id != plan["table"]["id"]:
        raise InputError(f"the plan was made from table {plan['table']['id']}, not {table.table_id}")
    bands = plan.get("intervals", {}).get("bands", {})
    fit = fused_factor(plan, points, out, table)
    again = recalibrated_table(table, *fit, out / "recalibrated-table.json") if fit else None
    lines = [f"# Mechanisms: blind predictions against the real engine ({out.name})", "",
             f"Plan from table {table.table_id}, made {plan['table']['created_at']}; predictions and "
             f"{plan.get('intervals', {}).get('level', '-')}% bands frozen in plan.json before any real run. "
             "Real: the mean of the repeats (min-max in brackets). Errors are (predicted - measured) / measured.", ""]
    if fit:
        lines += [f"Re-calibrated (fused steps only): the closed mixed controls' {fit[1]} prefill and fused steps "
                  f"took {fit[0]:.3f}x the blind model's time; that factor priced the rate points again.", ""]
    lines += ["| point | served blind / re-cal / real (req/s) | TTFT p50 blind / re-cal / real (ms) | TTFT p50 band "
              "(ms) | TTFT p95 blind / real (ms) | TPOT p50 blind / real (ms) | other |", "|---|---|---|---|---|---|---|"]
    targets = {"served within 3% (re-calibrated where there is one)": [], "TTFT p50 inside the band": []}
    for p in points:
        runs = complete_runs(out, p)
        if not runs:
            continue
        blind = plan["predictions"][p.id]
        real = {k: _mean(runs, k) for k in KEYS}
        re = None
        if again is not None and p.serving.prefill.fuses and p.trace["kind"] != "closed-mixed":
            re = predict(again, p, out)
        best = (re or blind)["served_rate"]
        err = (best - real["served_rate"][0]) / real["served_rate"][0]
        targets["served within 3% (re-calibrated where there is one)"].append((abs(err) <= SERVED_LIMIT, p.id, err))
        band = bands.get(p.id, {}).get("ttft_p50")
        inside = band is not None and all(band["lo"] <= summary(r, r.meta.get("trace", {}).get("rate"))["ttft_p50"]
                                          <= band["hi"] for r in runs)
        if band is not None:
            targets["TTFT p50 inside the band"].append((inside, p.id, None))
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

        lines.append(f"| {p.id} | {f(blind['served_rate'])} / {f(re and re['served_rate'])} / {m('served_rate')} "
                     f"({err:+.1%}) | {f(blind['ttft_p50'], 1e3, 0)} / {f(re and re['ttft_p50'], 1e3, 0)} / "
                     f"{m('ttft_p50', 1e3, 0)} | {f(band and band['lo'], 1e3, 0)}-{f(band and band['hi'], 1e3, 0)}"
                     f"{'' if inside else ' (out)'} | {f(blind['ttft_p95'], 1e3, 0)} / {m('ttft_p95', 1e3, 0)} | "
                     f"{f(blind['tpot_p50'], 1e3, 2)} / {m('tpot_p50', 1e3, 2)} | {other} |")
    lines += ["", "## Targets", "", "| target | met | missed at |", "|---|---|---|"]
    for name, rows in targets.items():
        missed = [f"{i} ({e:+.1%})" if e is not None else i for ok, i, e in rows if not ok]
        lines.append(f"| {name} | {sum(ok for ok, _, _ in rows)} of {len(rows)} | {', '.join(missed) or '-'} |")
    atomic_write_text(dest, "\n".join(lines) + "\n")
    return dest
