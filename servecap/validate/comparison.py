"""A validation's points compared: each point's prediction, made at plan time from the frozen table, beside its
measured repeats and the sampling spread of its trace (Compared), for every point with real records (compare).

The protocol is checked, not assumed: a run made before the table existed, or planned against another table, is
refused (an error naming the point), since its prediction could not have been blind.
"""
from __future__ import annotations

import json
import math
import statistics
import warnings
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np

from servecap.costs.model import CostModel
from servecap.sim import inputs
from servecap.sim.simulator import SimConfig, simulate
from servecap.traces.errors import InputError
from servecap.traces.metrics import scored, summary, token_gaps
from servecap.traces.records import RunRecord

from .points import Point, build_trace, complete_runs, load_plan, rel_error, run_dir

SPREAD_SEEDS = 10  # trace seeds the sampling spread of a seeded point is measured over


@dataclass
class Compared:
    point: Point
    rate: float | None
    sim: dict
    real: list[dict] = field(default_factory=list)  # one per repeat
    meta: list[dict] = field(default_factory=list)
    blind: dict | None = None
    spread: dict | None = None  # sd of served rate and queue p50 over trace seeds (seeded traces only)

    @property
    def measured(self) -> dict:
        return {k: statistics.median(r[k] for r in self.real) for k in self.real[0] if _number(self.real[0][k])}

    def err(self, key: str, pred: dict | None = None) -> float:
        pred = self.sim if pred is None else pred
        return rel_error(_num(pred.get(key)), _num(self.measured.get(key)), key)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _num(v) -> float:
    return float(v) if _number(v) else math.nan


def _scored(rec: RunRecord, rate: float | None, tokens: bool) -> dict:
    s = scored(rec, rate)
    if tokens and len(rec.tokens):
        s["gap_max"] = token_gaps(rec)["gap_max"]
    return s


def _when(iso: str | None) -> float:
    return datetime.fromisoformat(iso).timestamp() if iso else math.nan


def plan_table(out: Path) -> Path:
    """The cost table the plan in out was made from: the path it names, or, where that file now holds another table
    (a GPU that served two calls of one validation refreshed the table twice under one name, and the later copy is
    kept beside it with a suffix), the sibling of that name whose id is the plan's."""
    named = json.loads((Path(out) / "plan.json").read_text())["table"]
    path = Path(named["path"])
    for p in [path, *sorted(path.parent.glob(f"{path.stem}?*.json"))]:
        if p.is_file() and json.loads(p.read_text()).get("table_id") == named["id"]:
            return p
    return path  # compare() names the mismatch


def own_table(out: Path) -> Path | None:
    """The table the plan in out was made from, where that file is here (plan_table); else None."""
    try:
        path = plan_table(out)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no readable plan: the step that reads it says so
    return path if path.is_file() else None


def compare(out: Path, table_path: Path | None, allow_nonstationary: bool = False) -> tuple[dict, list[Compared]]:
    """Every point with real records, after the protocol checks."""
    plan, points = load_plan(out)
    table = inputs.load_table(table_path, allow_nonstationary=allow_nonstationary)
    if table.table_id != plan["table"]["id"]:
        raise InputError(f"the plan was made from cost table {plan['table']['id']}, not {table.table_id}; grade it "
                         f"against its own table (--table)", path=Path(out) / "plan.json")
    made = _when(table.created_at)
    if math.isnan(made):
        warnings.warn(f"cost table {table.table_id} has no creation time: whether each run came after it is not checked")
    planned = _when(plan.get("created_at"))  # provenance, stamped once every prediction is in the plan
    if math.isnan(planned):
        warnings.warn("the plan has no creation time: whether each run came after it is not checked")
    missing = [p.id for p in points if not complete_runs(out, p)]
    if missing:
        warnings.warn(f"{len(missing)} point(s) have no complete real records and are not graded: {', '.join(missing)}")
    blind = plan.get("blind", {}).get("predictions", {})
    results = []
    for p in points:
        runs = complete_runs(out, p)
        if not runs:
            continue
        planned_under = _planned_under(out, plan, p)
        trace = build_trace(p.trace, out)
        for r in runs:
            if r.meta["trace_id"] != trace.trace_id:
                raise InputError(f"point {p.id}: the real run replayed trace {r.meta['trace_id']}, the plan's is "
                                 f"{trace.trace_id}")
            if r.meta.get("plan_table_id") not in planned_under:
                raise InputError(f"point {p.id}: a real run was planned against cost table {r.meta.get('plan_table_id')}"
                                 f", not the plan's {plan['table']['id']}")
            if not math.isnan(made) and not _when(r.meta.get("created_at")) >= made:
                raise InputError(f"point {p.id}: a real run ({r.meta.get('created_at')}) was made before cost table "
                                 f"{table.table_id} existed ({table.created_at}): its prediction was not blind")
            if not math.isnan(planned) and not _when(r.meta.get("created_at")) >= planned:
                raise InputError(f"point {p.id}: a real run ({r.meta.get('created_at')}) was made before the plan "
                                 f"({plan.get('created_at')}; an earlier plan's run?): its prediction was not blind; "
                                 f"run the point again (validate real)", path=Path(out) / "plan.json")
        rate = trace.meta.get("rate") or trace.offered_rate
        results.append(Compared(p, rate, plan["predictions"][p.id], [_scored(r, rate, p.tokens) for r in runs],
                                [r.meta for r in runs], blind.get(p.id), _spread(table, p, rate)))
    return plan, results


def _planned_under(out: Path, plan: dict, p: Point) -> set[str]:
    """The tables a run of point p graded here may have been planned against: this plan's, and that of any plan on
    the same points: the one whose points it predicts (--points-from), and the plan that made the run where it is
    another's (real/, or real/POINT, a link into that plan's directory), when both took their points from the same
    plan or it took them from this one. Every such plan predicted the points before the runs, which the checks on
    each run's time confirm."""
    def origin(q: dict) -> str:
        return (q.get("points_from") or {}).get("table_id", q["table"]["id"])
    tables = {plan["table"]["id"], origin(plan)}
    # run-k, POINT, real/, the plan's directory: each plan read once, however many of the repeats it made
    holders = {run_dir(out, p, k).resolve().parents[2] for k in range(1, p.repeats + 1)} - {Path(out).resolve()}
    for holder in holders:
        if (holder / "plan.json").exists():
            other, _ = load_plan(holder)
            if origin(other) == origin(plan):
                tables.add(other["table"]["id"])
    return tables


def _spread(table, p: Point, rate: float | None) -> dict | None:
    """The sampling spread of a seeded arrival point: served rate and queue wait p50 over SPREAD_SEEDS trace seeds
    (the same workload, rate and configuration; only the draw differs)."""
    if rate is None or p.trace["kind"] not in ("poisson", "synthetic"):
        return None
    cost = CostModel(table)
    cfg = SimConfig(p.serving)
    got = []
    for seed in range(SPREAD_SEEDS):
        s = summary(simulate(build_trace({**p.trace, "seed": seed}, Path(".")), cost, cfg).record, rate)
        got.append((s["served_rate"], s["queue_wait_p50"]))
    served, wait = np.array(got).T
    return {"served_rate": float(np.std(served, ddof=1)), "queue_wait_p50": float(np.std(wait, ddof=1))}
