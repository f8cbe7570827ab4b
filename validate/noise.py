"""The engine's run-to-run noise, measured from repeated real runs of one point (never assumed): for every group of
two or more complete real records of the same point in one validation directory (same trace, configuration and
session), each metric's spread over the repeats as the sd of its log; pooled per regime (closed runs, arrival
runs) over the groups, weighted by their degrees of freedom. Written as data with its sources
(costs/data/run_to_run.json); the prediction intervals widen by it (sim/intervals.py).

    python -m validate noise results/validation results/validation-recheck --out costs/data/run_to_run.json
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from traces.csvio import atomic_write_text
from traces.errors import InputError
from traces.provenance import git_commit, now_iso

METRICS = ("served_rate", "queue_wait_p50", "queue_wait_p95", "ttft_p50", "ttft_p95", "tpot_p50", "wall_time_s")


def _groups(validation: Path) -> dict[str, list[Path]]:
    real = Path(validation) / "real"
    if not real.is_dir():
        raise InputError("has no real/ directory of run records", path=validation)
    out = {}
    for point in sorted(p for p in real.iterdir() if p.is_dir()):
        runs = [r for r in sorted(point.glob("run-*")) if (r / "meta.json").exists()
                and json.loads((r / "meta.json").read_text()).get("status") == "complete"]
        if len(runs) >= 2:
            out[point.name] = runs
    return out


def measure(validations: list[Path]) -> dict:
    """Each repeated point's metrics and their log sd, and the pooled sd per regime and metric."""
    from traces.metrics import closed_run, summary
    from traces.records import read_run

    groups = []
    for v in validations:
        for point, runs in _groups(v).items():
            recs = [read_run(r) for r in runs]
            if len({r.meta["trace_id"] for r in recs}) > 1:
                raise InputError(f"point {point}: its repeats replayed different traces", path=v)
            rate = recs[0].meta["trace"].get("rate")
            values = []
            for rec in recs:
                s = summary(rec, rate)
                if rate is None:
                    s.update(closed_run(rec))
                values.append({k: float(s[k]) for k in METRICS if k in s and s[k] is not None
                               and math.isfinite(s[k]) and s[k] > 0})
            keys = [k for k in METRICS if all(k in x for x in values)]
            groups.append({"point": point, "source": [str(r) for r in runs], "regime": "arrival" if rate else "closed",
                           "gpus": sorted({r.meta["device"].get("uuid") or "?" for r in recs}),
                           "values": {k: [x[k] for x in values] for k in keys},
                           "log_sd": {k: float(np.std(np.log([x[k] for x in values]), ddof=1)) for k in keys}})
    if not groups:
        raise InputError("no point has two or more complete real runs: run-to-run noise cannot be measured")
    pooled: dict[str, dict] = {}
    for regime in ("closed", "arrival"):
        mine = [g for g in groups if g["regime"] == regime]
        for k in METRICS:
            have = [(len(g["values"][k]) - 1, g["log_sd"][k]) for g in mine if k in g["log_sd"]]
            if have:
                dof = sum(d for d, _ in have)
                pooled.setdefault(regime, {})[k] = {"sigma": float(math.sqrt(sum(d * s * s for d, s in have) / dof)),
                                                    "groups": len(have), "runs": dof + len(have)}
    return {"schema": "run-to-run-noise", "version": 1, "pooled": pooled, "groups": groups,
            "method": "per metric, the sd of log(metric) over the repeats of one point, pooled over points by "
                      "degrees of freedom, per regime", "created_at": now_iso(), "git_commit": git_commit()}


def write(validations: list[Path], out: Path, force: bool = False) -> dict:
    if Path(out).exists() and not force:
        raise InputError("already exists; pass --force to replace it", path=out)
    doc = measure(validations)
    atomic_write_text(Path(out), json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return doc
