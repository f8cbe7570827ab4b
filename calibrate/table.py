"""From measured runs to a cost table: the points, the fit, the retirement overhead and the accuracy check."""
from __future__ import annotations

import warnings

from traces.cost_table import SCHEMA, VERSION, validate

from .accuracy import check
from .cost_model import CostModel, ExtrapolationWarning, fit
from .points import decode_points, prefill_point, stats
from .sweep import Plan, Run

NOTES = (
    "Timings are the engine's own step rows (end - start), from closed runs made by `python -m calibrate`.",
    "A prefill step row spans admission, the padded prefill, the KV copy into the pool and the first token: "
    "admission's cost is inside the prefill costs.",
    "A decode step row spans the decode step, retirement, the record writes and the next pass's arrival check: "
    "it ends where the next step starts, so the rows tile a run's busy time. Decode points exclude a run's first "
    "and last steps; overhead.retire_s is the median extra time of the last step (where all the run's rows retire "
    "and their records are written to disk) over the fitted decode cost, per retired row.",
)


def overhead(cost: CostModel, runs: list[Run], samples: dict[str, dict]) -> dict:
    """Retirement's extra time over the fitted decode cost, per retired row (its records are written then)."""
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


def build_table(plan: Plan, runs: list[Run], samples: dict[str, dict], engine_meta: dict, calibration: dict) -> dict:
    """The validated cost table for `runs` (each measured in `samples`), with the engine's description."""
    backends = list(dict.fromkeys(r.backend for r in runs if r.kind == "decode"))
    decode_runs = [r for r in runs if r.kind == "decode"]
    table = {
        "schema": SCHEMA, "version": VERSION,
        "name": f"{engine_meta['model']['name']} on {engine_meta['device']['name']}",
        "device": engine_meta["device"], "model": engine_meta["model"],
        "block_size": engine_meta["block_size"], "max_batch": engine_meta["max_batch"],
        "max_tokens": engine_meta["max_tokens"], "software": engine_meta["software"],
        "created_at": engine_meta["created_at"], "git_commit": engine_meta["git_commit"], "host": engine_meta["host"],
        "calibration": {"plan": plan.name, **calibration},
        "notes": list(NOTES),
        "prefill": {"points": [prefill_point(r, samples[r.key]) for r in runs if r.kind == "prefill"]},
        "decode": {b: {"points": [p for r in decode_runs if r.backend == b
                                  for p in decode_points(r, samples[r.key], plan.window)]} for b in backends},
    }
    table["fit"] = fit(table)
    with warnings.catch_warnings():
        # The decode runs' last steps read a little past the points' K/V (the points' middle steps).
        warnings.simplefilter("ignore", ExtrapolationWarning)
        table["overhead"] = overhead(CostModel(table), decode_runs, samples)
        table["accuracy"] = check(CostModel(table), [r for r in runs if r.kind.startswith("check-")], samples)
    return validate(table)
