"""Predictions of what a prefill policy buys, made by the simulator from a cost table before the engine has the
policy: the forecast that real runs grade later (servecap/validate/report.py).

For each policy (padded, and the ones to predict) at the same seeded workload: the closed mixed 32-row run (wall
time, first-token time, the largest gap between an incumbent's consecutive tokens), arrival runs at three rates
around that policy's own simulated capacity (served rate, queue wait p50, TTFT p50/p95, largest gap), and the Azure
conversation window at the policy's capacity for it. The table need not have measured the policy's step shapes:
the cost model prices them from the shapes it did measure (servecap/costs/model.py states the assumption), and the file
says so. The points (traces and rates) are fixed here, so the validation plan runs exactly these.
"""
from __future__ import annotations

import json
import time
import warnings
from dataclasses import replace
from pathlib import Path

from servecap.core.config import ServingConfig
from servecap.core.policies import STUDIED
from servecap.sim import inputs
from servecap.sim.sweep import Workload
from servecap.traces.csvio import atomic_write_text
from servecap.traces.errors import InputError
from servecap.traces.provenance import provenance

from .plan import LARGE_POOL, _azure_window, _round, _scaled, capacity, predict
from .points import Point

KEYS = ("served_rate", "queue_wait_p50", "ttft_p50", "ttft_p95", "tpot_p50", "wall_time_s", "gap_max")


def make_predictions(table_path: Path | None, out: Path, *, azure: Path | None, n: int = 400, seed: int = 0,
                     policies: tuple[str, ...] = STUDIED, force: bool = False) -> dict:
    out = Path(out)
    if (out / "predictions.json").exists() and not force:
        raise InputError("already holds predictions; they are a record of what was predicted when. Choose another "
                         "--out, or pass --force", path=out / "predictions.json")
    if azure is None or not Path(azure).is_file():
        raise InputError("the predictions include the Azure conversation window: give its CSV with --azure PATH")
    table = inputs.load_table(table_path)
    workload = Workload(n, seed)
    window = _azure_window(azure, n)
    points, capacities = [], {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for policy in policies:
            tag = policy.replace(":", "")
            serving = LARGE_POOL.but(prefill=policy)
            cap = capacity(table, serving, workload)
            wcap = capacity(table, serving, Workload(base=window))
            capacities[policy] = {"seeded": cap, "azure_window": wcap}
            points.append(Point(f"{tag}-closed-mixed-32", "policy", {"kind": "closed-mixed", "n": 32, "seed": seed},
                                ServingConfig(prefill=policy), warmup=2, repeats=3, tokens=True))
            points += [Point(f"{tag}-rate-{_round(f * cap):g}", "policy",
                             {"kind": "poisson", "rate": _round(f * cap), "n": n, "seed": seed},
                             ServingConfig(prefill=policy), tokens=True) for f in (0.6, 1.0, 1.6)]
            p = _scaled(window, wcap, f"{tag}-azure-conv", out / "traces", "policy")
            points.append(replace(p, serving=p.serving.but(prefill=policy), tokens=True))
        predictions = {p.id: {k: v for k, v in predict(table, p, out).items() if k in KEYS + ("stable",)}
                       for p in points}
    derived = sorted({str(w.message) for w in caught if "no measured" in str(w.message)})
    doc = {"table": {"id": table.table_id, "created_at": table.created_at, "device": table.device_name,
                     "gpu_uuid": table.gpu_uuid, "policies_measured": list(table.policies)},
           "predicted_at": time.time(), "derived_cost_notes": derived, "capacity_sim": capacities, "n": n, "seed": seed,
           "points": [p.to_json() for p in points], "predictions": predictions, **provenance()}
    atomic_write_text(out / "predictions.json", json.dumps(doc, indent=1, default=float) + "\n")
    atomic_write_text(out / "predictions.md", markdown(doc))
    return doc


def markdown(doc: dict) -> str:
    t = doc["table"]
    lines = [f"# Prefill policies: predictions from cost table {t['id']} ({t['device']})", "",
             f"Made by `python -m validate predict` at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(doc['predicted_at']))} "
             f"(commit {doc.get('git_commit')}), before the engine ran any policy but "
             f"{', '.join(t['policies_measured'])}.", "", *[f"- {note}." for note in doc["derived_cost_notes"]], "",
             "Simulated capacity (highest stable rate) per policy: " + "; ".join(
                 f"{p} {c['seeded']:.3g} req/s (Azure window {c['azure_window']:.3g})" for p, c in doc["capacity_sim"].items())
             + ". Largest gap: the longest wait between an incumbent's consecutive tokens.", "",
             "| point | served req/s | queue p50 s | TTFT p50 s | TTFT p95 s | TPOT p50 s | wall s | largest gap s |",
             "|---|---|---|---|---|---|---|---|"]
    for pid, v in doc["predictions"].items():
        cells = [("-" if v[k] is None or v[k] != v[k] else f"{v[k]:.4g}") for k in KEYS]
        lines.append(f"| {pid} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
