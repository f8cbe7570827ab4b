"""A cost table rebuilt from its own measured runs with this version's calibration code (no GPU): for a change of
the cost model's form made after a calibration and before any real run is graded against it.

The points file holds every run the calibration measured, so the rebuilt table is what a fresh calibration with
this code would have written from the same measurements. It keeps the original's device, software and date, names
the table it was refitted from, and fills in what older engines did not record about themselves (their prefill
token buckets and query tile) from this version's engine, which must be the one that made the measurements.
"""
from __future__ import annotations

import json
import shlex
import time
from pathlib import Path

from servecap.core.policies import PREFILL
from servecap.costs.table import load_cost_table, save_cost_table
from servecap.traces.errors import InputError
from servecap.traces.provenance import git_commit

from .plan import FULL, FULL_LENGTH, LONG, QUICK, Plan, make_plan
from .store import PointsFile, points_path
from .table import build_table

PLANS = {p.name: p for p in (FULL, FULL_LENGTH, LONG, QUICK)}  # by the name a table's calibration records


def refit(source: Path, out: Path, points: Path | None, argv: list[str]) -> str:
    from servecap.engine.kernels.prefill_attention import GPU_BLOCK_M
    from servecap.engine.model_runner import prefill_buckets

    old = load_cost_table(source, allow_nonstationary=True)
    raw = old.raw
    cal = raw.get("calibration", {})
    plan = PLANS.get(cal.get("plan"))
    if plan is None:
        raise InputError(f"cost table {old.table_id} does not say which calibration plan made it", path=source)
    points = Path(points) if points else points_path(source)
    if not points.exists():
        raise InputError("the table's measured runs are not there (its points file); give it with --points", path=points)
    store = PointsFile(points, None)
    store.close()
    # Tables made before calibration measured fused steps have no fused runs: their plan is refitted without them.
    fused = any(json.loads(k).get("policy", "").startswith("mixed") for k in store.samples)
    policies = tuple(str(PREFILL[p].sample(plan.chunk)) for p in raw.get("engine", {}).get("policies", ["padded"])
                     if fused or not PREFILL[p].fuses)
    engine = dict(raw.get("engine", {}))
    engine.setdefault("prefill_buckets", prefill_buckets(raw["max_batch"] * (raw["max_tokens"] - plan.max_budget)))
    engine.setdefault("prefill_block_m", GPU_BLOCK_M)
    meta = {k: raw[k] for k in ("device", "model", "block_size", "max_batch", "max_tokens", "software", "created_at",
                                "git_commit", "host")}
    calibration = {**{k: v for k, v in cal.items() if k != "plan"},
                   "refit": {"from": old.table_id, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                             "git_commit": git_commit(), "command": shlex.join(["python", "-m", "calibrate", *argv])}}
    return fit_points(plan, store, tuple(cal.get("backends") or raw["decode"]), policies, {**meta, "engine": engine},
                      calibration, out)


def fit_points(plan: Plan, store: PointsFile, backends: tuple[str, ...], policies: tuple[str, ...], meta: dict,
               calibration: dict, out: Path) -> str:
    """The table `plan`'s runs in `store` (every one measured) give, with the engine's description `meta` (device,
    model, sizes, software, provenance, engine), written to `out`; returns its id."""
    runs = make_plan(plan, meta["max_batch"], backends, policies)
    missing = [r.label for r in runs if r.key not in store]
    if missing:
        raise InputError(f"the points file lacks {len(missing)} of the plan's runs (e.g. {missing[0]})",
                         path=store.path)
    table = build_table(plan, runs, store.samples, meta, calibration)
    table.pop("table_id")
    return save_cost_table(table, out)
