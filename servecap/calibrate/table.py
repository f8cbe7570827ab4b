"""From measured runs to a cost table: the points, the fit, the retirement overhead, the accuracy check and the
stationarity check."""
from __future__ import annotations

import warnings

import numpy as np

from servecap.costs.fit import fit
from servecap.costs.model import CostModel, ExtrapolationWarning
from servecap.costs.table import SCHEMA, STATIONARITY_LIMIT, VERSION, CostTable, check_table, table_id

from .accuracy import check
from .plan import Plan, Run
from .points import decode_points, first_over_again, prefill_points, stats

NOTES = (
    "Timings are the engine's own step rows (end - start), from closed runs made by `python -m calibrate`.",
    "A prefill step row spans admission, the prefill (padded, packed or one chunk), the KV store into the pool and "
    "the first tokens: admission's cost is inside the prefill costs.",
    "A decode step row spans the decode step and retirement; the host work after it (the next pass's arrival check "
    "and plan) is the next row's: a busy engine's rows meet end to start, so they tile a run's busy time. A pass's "
    "records are written while the next pass's first step runs on the device (tables made before the engine wrote "
    "behind hold those writes in the next row). A decode point's step lasts until the next step starts (points "
    "measured before the rows tiled hold the host work so too). Decode points exclude a run's first and last steps; "
    "overhead.retire_s is the median extra time of the last step (where all the run's rows retire) over the fitted "
    "decode cost, per retired row.",
    "stationarity: shapes the engine had never run, each timed on its first run and on repeats (first / repeat).",
)


def overhead(cost: CostModel, runs: list[Run], samples: dict[str, dict]) -> dict:
    """Retirement's extra time over the fitted decode cost, per retired row."""
    extra = []
    for run in runs:
        s = samples[run.key]
        last = s["end"][-1] - s["start"][-1]
        extra.append((last - float(cost.decode(run.backend, run.width, s["kv_tokens"][-1], s["kv_max"][-1])))
                     / run.width)
    st = stats(extra)
    # A negative median is noise around no overhead; the simulator adds retire_s per row retiring in a step.
    return {"retire_s": max(0.0, st["median_s"]), "retire_p10_s": st["p10_s"], "retire_p90_s": st["p90_s"],
            "retire_n": st["n"]}


def stationarity(runs: list[Run], samples: dict[str, dict], limit: float = STATIONARITY_LIMIT) -> dict:
    """First-run over repeat times of the never-run shapes, summarised per kind; passed when both p95s are within
    the limit."""
    shapes = [{"run": r.label, "kind": r.kind.split("-")[1], "policy": r.policy, "prompts": list(r.prompts),
               "first_over_again": first_over_again(r, samples[r.key]),
               **{k: samples[r.key][k] for k in ("settle_s", "sm_clock_mhz") if k in samples[r.key]}} for r in runs]
    out = {"limit": limit}
    for kind in ("prefill", "decode"):
        v = np.array([s["first_over_again"] for s in shapes if s["kind"] == kind])
        out[kind] = {"n": int(v.size), "median": float(np.median(v)), "p95": float(np.percentile(v, 95)),
                     "max": float(v.max())}
    out["passed"] = all(out[k]["p95"] <= limit for k in ("prefill", "decode"))
    out["shapes"] = shapes
    return out


def build_table(plan: Plan, runs: list[Run], samples: dict[str, dict], engine_meta: dict, calibration: dict) -> dict:
    """The checked cost table (its JSON object) for `runs` (each measured in `samples`), with the engine's
    description."""
    backends = list(dict.fromkeys(r.backend for r in runs if r.kind == "decode"))
    decode_runs = [r for r in runs if r.kind == "decode"]
    prefill = [p for r in runs if r.kind == "prefill" for p in prefill_points(r, samples[r.key])]
    decode = {b: [p for r in decode_runs if r.backend == b for p in decode_points(r, samples[r.key], plan.window)]
              for b in backends}
    table = {
        "schema": SCHEMA, "version": VERSION,
        "name": f"{engine_meta['model']['name']} on {engine_meta['device']['name']}",
        "device": engine_meta["device"], "model": engine_meta["model"], "engine": engine_meta.get("engine", {}),
        "block_size": engine_meta["block_size"], "max_batch": engine_meta["max_batch"],
        "max_tokens": engine_meta["max_tokens"], "software": engine_meta["software"],
        "created_at": engine_meta["created_at"], "git_commit": engine_meta["git_commit"], "host": engine_meta["host"],
        "calibration": {"plan": plan.name, **calibration},
        "notes": list(NOTES),
        "prefill": {"points": prefill},
        "decode": {b: {"points": pts} for b, pts in decode.items()},
        "fit": fit(prefill, decode, engine_meta.get("engine")),
        "stationarity": stationarity([r for r in runs if r.kind.startswith("stationary-")], samples),
    }
    with warnings.catch_warnings():
        # The decode runs' last steps read a little past the points' K/V (the points' middle steps).
        warnings.simplefilter("ignore", ExtrapolationWarning)
        cost = CostModel(CostTable(table))
        table["overhead"] = overhead(cost, decode_runs, samples)
        table["accuracy"] = check(CostModel(CostTable(table)), [r for r in runs if r.kind.startswith("check-")], samples)
    table["table_id"] = table_id(table)
    return check_table(table)
