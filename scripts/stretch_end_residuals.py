"""What a decode step holds by its place in its stretch: the look at real runs that led to the cost model's
stretch-end term (servecap/costs/context.py).

Each complete single-engine run record under the given directories: every decode step priced by the table's closed
runs at its shape (no serving correction), the run's speed taken over its steps inside a stretch (neither first
nor last of one: servecap/costs/recorded.py stretch_ends), and each decode step's time less its retirement's
overhead over that speed's price, in ms. Per prefill policy, the mean of that over:
- the steps that end a stretch of two or more steps, by the stretch's length;
- the steps that end one, by what ends it (rows retired then a prefill or fused step, rows retired then a decode
  step, or cut at an admission: no row retired, a prefill or fused step next) and by their rows;
- the step before the last of a stretch of three or more (the engine's margin rule stops launching ahead there);
- a stretch's first step, where it is not also its last, by the step before it.

    python scripts/stretch_end_residuals.py --table T RUN_DIR_OR_VALIDATION ...
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

from servecap.calibrate.from_runs import find_runs
from servecap.costs.model import CostModel
from servecap.costs.recorded import held_s, stretch_ends
from servecap.sim.inputs import load_table
from servecap.traces.command import Parser, command
from servecap.traces.errors import InputError
from servecap.traces.records import read_run

GROUPS = ("ends a stretch, by its steps", "ends a stretch, by what ends it", "ends a stretch, by its rows",
          "the step before the last", "a stretch's first step, by the step before it")
LENGTHS = [(2, 2), (3, 4), (5, 8), (9, 16), (17, 32), (33, 10**9)]
ROWS = [(1, 4), (5, 8), (9, 16), (17, 24), (25, 32), (33, 10**9)]


def _bucket(n: int, bounds) -> str:
    lo, hi = next((lo, hi) for lo, hi in bounds if lo <= n <= hi)
    return f"{lo}+" if hi == 10**9 else f"{lo}-{hi}" if hi > lo else f"{lo}"


def classify(rec, cost: CostModel) -> pd.DataFrame:
    """One row per decode step of one engine's record: its classes (`group`, `cls`) and what it holds over the
    run's speed inside a stretch (`extra_ms`); steps in no class are left out."""
    steps = rec.steps.sort_values(["replica", "start"], kind="stable").reset_index(drop=True)
    dec = (steps.kind == "decode").to_numpy()
    backend = rec.meta["backend"]
    price = np.full(len(steps), np.nan)
    for rows, idx in steps[dec].groupby("rows").groups.items():
        d = steps.loc[idx]
        price[idx] = cost.decode(backend, int(rows), d.kv_tokens.to_numpy(), d.kv_max.to_numpy())
    real = held_s(steps, rec.requests) - cost.retire_s * steps.retired.to_numpy() * dec
    ends = stretch_ends(steps)
    kind = steps.kind.to_numpy().astype(object)
    same = np.r_[False, steps.replica.to_numpy()[1:] == steps.replica.to_numpy()[:-1]]  # as the step before it
    before = np.where(same, np.concatenate([[""], kind[:-1]]), "")
    retired_before = same & (np.r_[0, steps.retired.to_numpy()[:-1]] > 0)
    first = dec & ~((before == "decode") & ~retired_before & (np.r_[0, ends[:-1]] == 0))
    nxt = np.where(np.r_[same[1:], False], np.concatenate([kind[1:], [""]]), "")
    length = np.zeros(len(steps), int)  # each step's stretch's length, from its end back to its first
    start = 0
    for i in np.flatnonzero(dec):
        if first[i]:
            start = i
        if ends[i]:
            length[start:i + 1] = ends[i]
    inside = dec & ~first & (ends == 0)
    if not inside.any():
        return pd.DataFrame(columns=["group", "cls", "extra_ms"])
    f = real[inside].sum() / price[inside].sum()
    extra = 1e3 * (real - f * price)
    retired = steps.retired.to_numpy() > 0
    out = []
    for i in np.flatnonzero(dec):
        if ends[i] and not first[i]:
            out.append(("ends a stretch, by its steps", _bucket(int(ends[i]), LENGTHS), extra[i]))
            why = ("rows retired, then a decode step" if retired[i] and nxt[i] == "decode" else
                   "rows retired, then a prefill step" if retired[i] and nxt[i] else
                   "cut at an admission" if nxt[i] in ("prefill", "mixed") else None)
            if why:
                out.append(("ends a stretch, by what ends it", why, extra[i]))
            out.append(("ends a stretch, by its rows", _bucket(int(steps.rows.iat[i]), ROWS), extra[i]))
        elif not ends[i] and not first[i] and i + 1 < len(steps) and ends[i + 1] and length[i] >= 3:
            out.append(("the step before the last", "stretches of 3 or more", extra[i]))
        elif first[i] and not ends[i]:
            out.append(("a stretch's first step, by the step before it",
                        "retired rows" if retired_before[i] else before[i] or "none (idle)", extra[i]))
    return pd.DataFrame(out, columns=["group", "cls", "extra_ms"])


def table(paths: list[Path], cost: CostModel) -> pd.DataFrame:
    """classify() over every complete single-engine run under `paths`, with its prefill policy."""
    parts = []
    for d in find_runs(paths):
        rec = read_run(d)
        if int(rec.meta.get("replicas", 1) or 1) > 1:
            continue
        parts.append(classify(rec, cost).assign(policy=rec.meta.get("prefill", "padded").partition(":")[0]))
    if not parts:
        raise InputError("holds no complete run of one engine", path=paths[0])
    return pd.concat(parts, ignore_index=True)


@command("stretch_end_residuals")
def main(argv: list[str] | None = None) -> int:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", type=Path, metavar="DIR")
    ap.add_argument("--table", type=Path, required=True, help="the cost table whose closed-run prices are used")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    df = table(args.paths, CostModel(load_table(args.table)))
    print("ms a decode step holds over its run's speed inside a stretch (mean, steps), per prefill policy")
    policies = sorted(df.policy.unique())
    for group in (x for x in GROUPS if x in set(df.group)):
        g = df[df.group == group]
        print(f"\n{group}:")
        cells = g.groupby(["cls", "policy"]).extra_ms.agg(["mean", "size"]).unstack("policy")
        print(f"  {'':36s}" + "".join(f"{p:>18s}" for p in policies))
        for cls in sorted(set(g.cls), key=lambda c: (not c[0].isdigit(), int(c.split("-")[0].rstrip("+"))
                                                     if c[0].isdigit() else 0, c)):
            mean, size = cells.loc[cls, "mean"], cells.loc[cls, "size"]
            print(f"  {cls:36s}" + "".join(f"{mean[p]:+10.3f} ({int(size[p]):5d})" if pd.notna(size.get(p))
                                            else f"{'-':>18s}" for p in policies))
    return 0


if __name__ == "__main__":
    sys.exit(main())
