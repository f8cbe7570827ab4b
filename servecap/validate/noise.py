"""The engine's run-to-run noise, measured from repeated real runs of one point (never assumed): for every group of
two or more complete real records of the same point in one validation directory (same trace, configuration and
session), each metric's spread over the repeats as the sd of its log; pooled per regime (closed runs, arrival
runs) over the groups, weighted by their degrees of freedom. Written as data with its sources
(servecap/costs/data/run_to_run.json); the prediction intervals widen by it (servecap/sim/intervals.py).

With a cost table (--table), the spread is split in two. A run's speed: its recorded steps' summed time over the
table's price for them in their serving context (servecap/costs/recorded.py); repeats of one point differ in it by a percent
or two, and near capacity that alone moves TTFT by tens of percent, as the simulator shows when it replays the
point at each run's own speed. What speed does not explain: the sd over the repeats of log(measured / simulated at
the run's speed), per metric. The intervals propagate the first through the simulator (a cost factor) and widen
by the second, so that neither is counted twice. And the speed's spread from GPU to GPU: the sd of the sessions'
mean log speeds (a session is one validation directory on one GPU).

What speed leaves is pooled a second time by load, as the simulator judges it at the runs' own speeds (summary's
`stable`: kept up with its arrivals): below capacity a queue's waits swing with the run's own arrival luck against a
server barely keeping up, past it the backlog sets them, so the two regimes' residuals differ several-fold (pooled
`arrival-stable` and `arrival-unstable`; the intervals mix them by the share of a point's samples that are stable).

    python -m validate noise results/validation results/validation-v2 ... --table T --out servecap/costs/data/run_to_run.json
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from servecap.traces.csvio import atomic_write_text
from servecap.traces.errors import InputError
from servecap.traces.provenance import git_commit, now_iso

METRICS = ("served_rate", "queue_wait_p50", "queue_wait_p95", "ttft_p50", "ttft_p95", "tpot_p50", "wall_time_s")


def runs_by_point(validation: Path, min_runs: int = 2) -> dict[str, list[Path]]:
    """The complete run records of each point of a validation's real/ that has `min_runs` or more of them."""
    from servecap.traces.records import is_complete

    real = Path(validation) / "real"
    if not real.is_dir():
        raise InputError("has no real/ directory of run records", path=validation)
    out = {}
    for point in sorted(p for p in real.iterdir() if p.is_dir()):
        runs = [r for r in sorted(point.glob("run-*")) if is_complete(r)]
        if len(runs) >= min_runs:
            out[point.name] = runs
    return out


def speed_and_residuals(validation: Path, p, recs: list, table) -> tuple[list[float], list[dict], list[bool]]:
    """Each run's speed (summed real step time over its contextual price), log(measured / simulated at that
    speed) per metric, and whether that simulated run was stable, for point p of the validation's plan."""
    from servecap.costs.model import CostModel
    from servecap.costs.recorded import contextual, priced_steps
    from servecap.sim.intervals import scaled

    from .plan import point_simulation

    cost = CostModel(table)
    trace, rate, run = point_simulation(p, validation)
    speeds, residuals, stable = [], [], []
    for rec in recs:
        steps = priced_steps(rec, cost)
        f = float(steps.real_s.sum() / contextual(steps, cost.correction).sum())
        sim = run(trace, scaled(table, f))
        speeds.append(f)
        stable.append(bool(sim.get("stable")))
        residuals.append({k: math.log(v / sim[k]) for k, v in _metrics(rec, rate).items()
                          if sim.get(k) is not None and math.isfinite(sim[k]) and sim[k] > 0})
    return speeds, residuals, stable


def _metrics(rec, rate) -> dict:
    from servecap.traces.metrics import scored
    s = scored(rec, rate)
    return {k: float(s[k]) for k in METRICS if k in s and s[k] is not None and math.isfinite(s[k]) and s[k] > 0}


def _sd(values) -> float:
    return float(np.std(values, ddof=1))


def _residuals(groups: list[dict], metric: str) -> list[tuple[int, float]]:
    """(degrees of freedom, sd of what speed leaves of `metric`) of each group measured with a table, for _pool."""
    return [(len(g["speed"]) - 1, g["residual_log_sd"][metric]) for g in groups
            if metric in g.get("residual_log_sd", {})]


def _pool(have: list[tuple[int, float]]) -> dict:
    dof = sum(d for d, _ in have)
    return {"sigma": float(math.sqrt(sum(d * s * s for d, s in have) / dof)), "groups": len(have),
            "runs": dof + len(have)}


def measure(validations: list[Path], table=None) -> dict:
    """Each repeated point's metrics and their log sd, and the pooled sd per regime and metric; with `table` (a
    CostTable) also each run's speed and what speed leaves unexplained (module docstring)."""
    from tqdm import tqdm

    from servecap.traces.records import read_run

    from .points import load_plan

    groups = []
    for v in tqdm(validations, desc="noise", unit="validation", disable=table is None, leave=False, delay=2):
        plan = {p.id: p for p in load_plan(Path(v))[1]} if table is not None else {}
        for point, runs in runs_by_point(v).items():
            recs = [read_run(r) for r in runs]
            if len({r.meta["trace_id"] for r in recs}) > 1:
                raise InputError(f"point {point}: its repeats replayed different traces", path=v)
            rate = recs[0].meta["trace"].get("rate")
            values = [_metrics(rec, rate) for rec in recs]
            keys = [k for k in METRICS if all(k in x for x in values)]
            g = {"point": point, "validation": str(v), "source": [str(r) for r in runs],
                 "regime": "arrival" if rate else "closed", "gpus": sorted({r.meta["device"].get("uuid") or "?"
                                                                           for r in recs}),
                 "values": {k: [x[k] for x in values] for k in keys},
                 "log_sd": {k: _sd(np.log([x[k] for x in values])) for k in keys}}
            if table is not None:
                if point not in plan:
                    raise InputError(f"point {point} has real runs but is not in the plan", path=v)
                speeds, residuals, stable = speed_and_residuals(Path(v), plan[point], recs, table)
                rk = [k for k in keys if all(k in r for r in residuals)]
                g.update(speed=speeds, speed_log_sd=_sd(np.log(speeds)), sim_stable=stable,
                         residual_log_sd={k: _sd([r[k] for r in residuals]) for k in rk})
            groups.append(g)
    if not groups:
        raise InputError("no point has two or more complete real runs: run-to-run noise cannot be measured")
    pooled: dict[str, dict] = {}
    for regime in ("closed", "arrival"):
        mine = [g for g in groups if g["regime"] == regime]
        for k in METRICS:
            have = [(len(g["values"][k]) - 1, g["log_sd"][k]) for g in mine if k in g["log_sd"]]
            if have:
                pooled.setdefault(regime, {})[k] = _pool(have)
                res = _residuals(mine, k)
                if res:
                    pooled[regime][k]["residual_sigma"] = _pool(res)["sigma"]
        speed = [(len(g["speed"]) - 1, g["speed_log_sd"]) for g in mine if "speed" in g]
        if speed:
            pooled.setdefault(regime, {})["speed"] = _pool(speed)
    for load in ("stable", "unstable"):
        mine = [g for g in groups if g["regime"] == "arrival" and "sim_stable" in g
                and (sum(g["sim_stable"]) * 2 > len(g["sim_stable"])) == (load == "stable")]
        for k in METRICS:
            res = _residuals(mine, k)
            if res:
                pool = _pool(res)
                pooled.setdefault(f"arrival-{load}", {})[k] = {"residual_sigma": pool.pop("sigma"), **pool}
    sessions = _sessions(groups)
    return {"schema": "run-to-run-noise", "version": 2 if table is not None else 1, "pooled": pooled,
            "groups": groups, **({"table": table.table_id} if table is not None else {}),
            **({"sessions": sessions} if sessions else {}),
            "method": "per metric, the sd of log(metric) over the repeats of one point, pooled over points by "
                      "degrees of freedom, per regime" + ("; speed: the sd of the log of each run's summed step "
                      "time over the table's contextual price; residual_sigma: the same pooling of log(measured / "
                      "simulated at the run's own speed), also by load (arrival-stable, arrival-unstable: the "
                      "simulator's verdict at the runs' speeds, by majority)" if table is not None else ""),
            "created_at": now_iso(), "git_commit": git_commit()}


def describe(doc: dict) -> str:
    """The pooled noise in a line: each regime's sd per metric and what speed leaves of it."""
    def one(v: dict) -> str:
        return " ".join(([f"{v['sigma']:.1%}"] if "sigma" in v else [])
                        + ([f"({v['residual_sigma']:.1%} beyond speed)"] if "residual_sigma" in v else []))
    return f"{len(doc['groups'])} repeated points; " + "; ".join(
        f"{regime}: " + ", ".join(f"{k} {one(v)}" for k, v in m.items()) for regime, m in doc["pooled"].items())


def _sessions(groups: list[dict]) -> dict | None:
    """The GPU-to-GPU spread of a run's speed: each session's (one validation directory on one GPU) mean log speed
    over its repeated runs, and the sd of those means (None with fewer than three sessions)."""
    means: dict[str, list[float]] = {}
    for g in groups:
        if "speed" in g and len(g["gpus"]) == 1:
            means.setdefault(f"{g['validation']} {g['gpus'][0]}", []).extend(math.log(f) for f in g["speed"])
    if len(means) < 3:
        return None
    m = {k: float(np.mean(v)) for k, v in means.items()}
    return {"sigma": _sd(list(m.values())), "mean_log_speed": m}


def earlier_sessions(path: Path) -> dict:
    """The GPU-to-GPU spread of an earlier noise file, with where it came from: for an engine measured on fewer
    than three GPUs so far (the spread of a run's speed from GPU to GPU is the GPUs' and hosts', which an engine
    change moves less than its run-to-run noise)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        raise InputError("is not a readable run-to-run noise file", path=path) from None
    if doc.get("schema") != "run-to-run-noise" or not doc.get("sessions"):
        raise InputError("is not a run-to-run noise file with a GPU-to-GPU spread (sessions)", path=path)
    return {**doc["sessions"], "from": {"file": str(path), "created_at": doc.get("created_at"),
                                        "table": doc.get("table"), "git_commit": doc.get("git_commit")}}


def write(validations: list[Path], out: Path, force: bool = False, table=None,
          sessions_from: Path | None = None) -> dict:
    """Measure and write the noise file; `sessions_from`: take the GPU-to-GPU spread from that earlier file
    (earlier_sessions) instead of these validations' sessions."""
    if Path(out).exists() and not force:
        raise InputError("already exists; pass --force to replace it", path=out)
    # read before anything is written: the earlier file may be the one this replaces
    sessions = earlier_sessions(sessions_from) if sessions_from is not None else None
    doc = measure(validations, table)
    if sessions is not None:
        doc["sessions"] = sessions
    atomic_write_text(Path(out), json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return doc
