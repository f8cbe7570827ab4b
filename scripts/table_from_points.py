"""A cost table fitted on the CPU from a calibration's points file, where the calibration measured every run but its
own fit refused the table (T7: the decode saving, fitted at short contexts, priced 32 rows beside one 32k row below
zero; the fit now has a floor). The engine's description (prefill buckets, query tile, device, software, host) comes
from a run record made by the same engine configuration on the same GPU in the same device call; the table says so.

  python scripts/table_from_points.py POINTS_JSONL RUN_META_JSON --plan full-length --out TABLE.json
"""
from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

from servecap.calibrate.refit import PLANS, fit_points
from servecap.calibrate.store import PointsFile
from servecap.core.policies import every_policy
from servecap.costs.table import load_cost_table
from servecap.traces.command import Parser, command
from servecap.traces.errors import InputError
from servecap.traces.provenance import git_commit


@command("table_from_points")
def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("points", type=Path)
    p.add_argument("run_meta", type=Path, help="meta.json of a run by the same engine on the same GPU")
    p.add_argument("--plan", choices=("full", "full-length", "long"), required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    plan = PLANS[args.plan]
    store = PointsFile(args.points, None)
    store.close()
    ident = json.loads(args.points.read_text().splitlines()[0])["identity"]
    meta = json.loads(args.run_meta.read_text())
    same_engine = meta["max_tokens"] == ident["max_prompt"] + ident["max_budget"]
    if meta["device"].get("uuid") != ident["gpu_uuid"] or not same_engine:
        raise InputError("was not made on the calibration's GPU and engine size", path=args.run_meta)
    engine = {k: meta[k] for k in ("device", "model", "block_size", "max_batch", "max_tokens", "software",
                                   "created_at", "git_commit", "host", "engine")}
    calibration = {"points_file": str(args.points), "backends": ["paged"], "runs_measured_now": 0,
                   "runs_resumed": len(store.samples),
                   "engine_from": f"run record {args.run_meta} (same engine, same GPU)",
                   "fitted_on_cpu": {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                     "git_commit": git_commit(),
                                     "command": shlex.join(["python", "scripts/table_from_points.py", *sys.argv[1:]])}}
    tid = fit_points(plan, store, ("paged",), tuple(map(str, every_policy(plan.chunk))), engine, calibration, args.out)
    print(f"wrote cost table {tid} to {args.out}")
    table = load_cost_table(args.out, allow_nonstationary=True).raw
    from servecap.calibrate.accuracy import report
    from servecap.calibrate.cli import stationarity_line
    print(report(table["accuracy"]))
    print(stationarity_line(table["stationarity"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
