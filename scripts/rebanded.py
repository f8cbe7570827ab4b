"""Re-plan refreshed validations' 90% bands after their runs under one GPU-to-GPU rule, and grade them on the real
runs (retrospective: the tables did not see the runs, but the noise file may have, and the choice to look did).

--rule held: the rule of servecap/sim/intervals.py since commit 7aaf202, applied to tables made before it: each
table's correction is given the GPUs its held-out runs ran on (from those runs' records), so where they
are MIN_GPUS or more the cost sigma is the held-out term alone. --rule added: the tables as they are (no GPU count:
the sessions' GPU-to-GPU spread added in quadrature). Prints each validation's inside / graded, then near and past
capacity's, and how many bands' widths are within 2x the repeats' spread. --noise FILE: widen by that run-to-run
noise file instead of the shipped one (a file measured without the validations' runs keeps the noise out of sample).
--draws one: every step drawn by one factor, the whole run's sigma, as bands were before a883f8c (each table's
correction keeps its `all` residual alone); kind (the default): each step kind measured held out with its own; apart:
so, with decode's kinds and the prompt steps' drawn apart (servecap/sim/intervals.py).

    python scripts/rebanded.py --rule held|added DIR ... [--draws kind|one|apart] [--work /tmp/rebanded] [--noise FILE]
"""
from __future__ import annotations

import hashlib
import json
import statistics
import sys
import warnings
from pathlib import Path

from servecap.calibrate.from_runs import held_out_gpus
from servecap.costs.table import save_cost_table
from servecap.sim.inputs import load_table
from servecap.sim.intervals import Intervals, load_noise
from servecap.traces.command import Parser, command
from servecap.traces.errors import InputError
from servecap.validate.comparison import compare, plan_table
from servecap.validate.coverage import coverage
from servecap.validate.plan import point_band


def with_gpu_count(table_path: Path, out: Path) -> Path:
    """A copy of the table whose correction says what `--from-runs` now records of its held-out runs' GPUs
    (held_out_gpus, from the runs' meta.json and the errors the correction stored for them)."""
    raw = json.loads(table_path.read_text())
    held = raw["correction"]["held_out"]["runs"]
    metas = {Path(r): {"meta": json.loads((Path(r) / "meta.json").read_text())} for r in held}
    raw["correction"]["held_out_gpus"] = held_out_gpus(held, metas)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_cost_table(raw, out)
    return out


def one_factor(table_path: Path, out: Path) -> Path:
    """A copy of the table whose correction keeps the whole run's residual alone: its bands draw one factor."""
    raw = json.loads(table_path.read_text())
    sigma = (raw.get("correction") or {}).get("residual_sigma")
    if sigma:
        raw["correction"]["residual_sigma"] = {"all": sigma.get("all")}
    out.parent.mkdir(parents=True, exist_ok=True)
    save_cost_table(raw, out)
    return out


def rebanded(validation: Path, rule: str, work: Path, noise: dict | None = None,
             draws: str = "kind", made: dict | None = None) -> tuple[list, dict]:
    """The validation's compared points and the bands re-planned under `rule` and `draws` (widened by `noise`, else
    the shipped run-to-run noise), as `validate plan --interval 90` bands them. `made`: the bands re-planned so far,
    by plan and point, for validations that are copies of one plan graded on other GPUs' runs (a point is banded
    once)."""
    table = plan_table(validation)
    _, results = compare(validation, table)
    made = {} if made is None else made
    plan = hashlib.sha256((validation / "plan.json").read_bytes()).hexdigest()
    todo = [c for c in results if (plan, c.point.id) not in made]
    if todo:
        if rule == "held":
            table = with_gpu_count(table, work / "tables" / table.name)
        if draws == "one":
            table = one_factor(table, work / "one-factor" / table.name)
        table = load_table(table)
        iv = Intervals(table, 90.0, noise, apart=draws == "apart")
        made.update({(plan, c.point.id): point_band(iv, table, c.point, validation) for c in todo})
    return results, {c.point.id: made[(plan, c.point.id)] for c in results}


@command("rebanded")
def main(argv: list[str] | None = None) -> int:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("validations", nargs="+", type=Path, metavar="DIR")
    ap.add_argument("--rule", choices=("held", "added"), required=True)
    ap.add_argument("--draws", choices=("kind", "one", "apart"), default="kind",
                    help="each measured step kind drawn with its own sigma (default), or one factor on every step, "
                         "or each kind with its own and decode's apart from the prompt steps'")
    ap.add_argument("--work", type=Path, default=Path("/tmp/rebanded"), help="where the rewritten tables go")
    ap.add_argument("--noise", type=Path, help="a run-to-run noise file (default: the shipped one)")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    totals: dict[str, list] = {"near": [0, 0, [], []], "past": [0, 0, [], []]}
    noise = load_noise(args.noise) if args.noise else None
    made: dict = {}
    for v in args.validations:
        if not (v / "plan.json").is_file():
            raise InputError("holds no plan.json", path=v)
        results, bands = rebanded(v, args.rule, args.work, noise, args.draws, made)
        every = coverage(results, bands)
        print(f"{v}: {every['inside']} of {every['graded']} inside", flush=True)
        for load, t in totals.items():
            cov = coverage([c for c in results if c.point.load == load], bands)
            t[0] += cov["inside"]
            t[1] += cov["graded"]
            t[2] += [w["width"] / w["real_spread"] for w in cov["width_vs_real_spread"]]
            t[3] += [cov["metrics"]["served_rate"]["median_rel_width"]] if "served_rate" in cov["metrics"] else []
    for load, (inside, graded, ratios, widths) in totals.items():
        if graded:
            print(f"{load}: {inside} of {graded} inside ({inside / graded:.1%}); width within 2x the repeats' spread "
                  f"{sum(r <= 2 for r in ratios)} of {len(ratios)} (median {statistics.median(ratios):.1f}x); "
                  f"median served-rate width {statistics.median(widths):.1%}")
    inside, graded = (sum(t[i] for t in totals.values()) for i in (0, 1))
    print(f"near and past: {inside} of {graded} inside ({inside / graded:.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
