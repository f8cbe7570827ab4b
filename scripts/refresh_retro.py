"""Refreshed validations graded as if their refresh had applied only some of its readings (retrospective: the
readings are the ones each refresh took before its runs, but the choice of which to apply was made after them).

A refresh (servecap/calibrate/refresh.py) reads a prefill factor and a decode factor on the GPU at hand and
rescales the table by those it applies (on a GPU of the table's own name the decode one alone). For each refreshed
validation DIR this rebuilds the table its refresh started from (the plan table of DIR's validation,
`validation-vN`, else the table its refresh command names) rescaled by the readings of --apply alone, applied or
only recorded, re-plans DIR's points from it with 90% bands, and grades DIR's runs against that plan with
scripts/grade_validation.py's grading; then the pooled runs' error and the bands' coverage. `--apply none` rebuilds
the unrefreshed table. `--readings` instead sets, per session and step kind, what the refresh read against what the
GPU's serving steps then cost: the mean over the session's runs of log(price with every reading applied / unrefreshed
price) beside log(real / unrefreshed price), each run's steps of the kind summed; then per kind their correlation
over the sessions, the slope of the second on the first, and the sessions' RMS offset from either price.

    python scripts/refresh_retro.py --apply decode DIR ... [--work /tmp/refresh-retro]
    python scripts/refresh_retro.py --readings DIR ...
"""
from __future__ import annotations

import json
import math
import shlex
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from grade_validation import grade, pooled, replan  # noqa: E402

from servecap.calibrate.refresh import rescaled  # noqa: E402
from servecap.costs.model import CostModel  # noqa: E402
from servecap.costs.recorded import contextual, priced_steps  # noqa: E402
from servecap.costs.table import CostTable, as_cost_table, load_cost_table, save_cost_table, table_id  # noqa: E402
from servecap.traces.command import Parser, command  # noqa: E402
from servecap.traces.errors import InputError  # noqa: E402
from servecap.traces.records import read_run  # noqa: E402
from servecap.validate.comparison import compare, plan_table  # noqa: E402
from servecap.validate.points import complete_dirs  # noqa: E402


def tables(validation: Path) -> tuple[dict, CostTable]:
    """(the refreshed table `validation` was planned from, as stored; the table it was refreshed from: the plan
    table of the validation it is a call of (validation-vN-GPU's is validation-vN's), else the table its refresh
    command names, either only where its id is the one the refresh recorded)."""
    refreshed = plan_table(validation)
    raw = json.loads(refreshed.read_text())
    want = raw.get("refreshed_from", {}).get("table_id")
    whole = validation.parent / "-".join(validation.name.split("-")[:2])
    args = shlex.split(raw.get("refresh", {}).get("command", ""))
    named = [Path(args[args.index("--refresh") + 1])] if "--refresh" in args[:-1] else []
    for path in [plan_table(whole), *named]:
        old = load_cost_table(path, allow_nonstationary=True) if path.is_file() else None
        if old is not None and old.table_id == want:
            return raw, old
    raise InputError(f"was refreshed from table {want}, neither {whole}'s plan table nor one its refresh command "
                     f"names", path=refreshed)


def applied(validation: Path, which: str, out: Path) -> Path:
    """The table `validation`'s refresh started from, rescaled by that refresh's factors of kinds `which` alone,
    with the refreshed table's provenance (device, time), saved to `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    save_cost_table(rebuilt(*tables(validation), which), out)
    return out


def rebuilt(raw: dict, old: CostTable, which: str) -> dict:
    """`old`, the table a refresh started from, rescaled by that refresh's readings (in `raw`, the refreshed table)
    of kinds `which` alone, whether the refresh applied them or only recorded them, with raw's provenance."""
    keep = {k: f for k, f in raw["refresh"]["factors"].items() if which == "all" or k.split()[0] == which}
    table = rescaled(old.raw, keep)
    table.update({k: raw[k] for k in ("device", "software", "created_at", "git_commit", "host", "refreshed_from")},
                 name=f"{raw['name']}, {which} applied", refresh={**raw["refresh"], "applied": keep})
    table.pop("table_id", None)
    return {**table, "table_id": table_id(table)}


def readings(validation: Path) -> dict[str, tuple[float, float]]:
    """Per step kind (decode, prefill): (the move of its price that the refresh's reading makes, applied or not,
    where serving fell from the unrefreshed price), each the mean over the validation's runs of a log ratio of its
    steps' sums (module docstring)."""
    # Every reading applied, also one the refresh only recorded (a prefill reading on a GPU of the table's name).
    raw, old = tables(validation)
    costs = [CostModel(as_cost_table(rebuilt(raw, old, "all"), allow_nonstationary=True)), CostModel(old)]
    _, results = compare(validation, plan_table(validation))
    logs: dict[str, list[tuple[float, float]]] = {}
    for c in results:
        for d in complete_dirs(validation, c.point):
            rec = read_run(d)
            steps = [priced_steps(rec, cost) for cost in costs]
            prices = [s.assign(price=contextual(s, cost.correction)) for s, cost in zip(steps, costs)]
            for kind in ("decode", "prefill"):
                new, old = (p[p.step_kind == kind] for p in prices)
                if len(old):
                    logs.setdefault(kind, []).append((math.log(new.price.sum() / old.price.sum()),
                                                      math.log(old.real_s.sum() / old.price.sum())))
    return {kind: tuple(float(np.mean(x)) for x in zip(*v)) for kind, v in logs.items()}


def print_readings(validations: list[Path]) -> None:
    every = {v: readings(v) for v in validations}
    for v, r in every.items():
        print(f"{v}: " + ", ".join(f"{k} read {m:+.2%}, serving {t:+.2%}" for k, (m, t) in r.items()), flush=True)
    for kind in ("decode", "prefill"):
        moved, true = (np.array(x) for x in zip(*(r[kind] for r in every.values() if kind in r)))
        slope = np.polyfit(moved, true, 1)[0]
        print(f"{kind}: {len(moved)} sessions, correlation {np.corrcoef(moved, true)[0, 1]:+.2f}, slope {slope:.2f}; "
              f"the refresh read sd {moved.std():.2%}, the GPUs' serving offset sd {true.std():.2%}; RMS offset "
              f"from the unrefreshed price {np.sqrt(np.mean(true ** 2)):.2%}, from the refreshed "
              f"{np.sqrt(np.mean((true - moved) ** 2)):.2%}")


@command("refresh_retro")
def main(argv: list[str] | None = None) -> int:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("validations", nargs="+", type=Path, metavar="DIR")
    how = ap.add_mutually_exclusive_group(required=True)
    how.add_argument("--apply", choices=("decode", "prefill", "all", "none"), help="which of each refresh's readings "
                     "to apply")
    how.add_argument("--readings", action="store_true", help="each refresh's readings against its GPU's serving")
    ap.add_argument("--work", type=Path, default=Path("/tmp/refresh-retro"), help="where the tables and plans go")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    runs, inside, graded = {}, 0, 0
    for v in args.validations:
        if not (v / "plan.json").is_file():
            raise InputError("holds no plan.json", path=v)
    if args.readings:
        print_readings(args.validations)
        return 0
    for v in args.validations:
        table = applied(v, args.apply, args.work / "tables" / args.apply / f"{v.name}.json")
        g = grade(v, replanned=replan(v, table, args.work / args.apply / v.name))
        runs[v], cov = g.runs, g.bands
        inside, graded = inside + cov["all"]["inside"], graded + cov["all"]["graded"]
    print(pooled(runs))
    print(f"90% bands: {inside} of {graded} inside ({inside / graded:.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
