"""What two candidate terms of a serving correction would buy on the runs it was fitted from: the GPU's temperature,
and a prefill step's token bucket.

Usage: python scripts/candidate_terms.py TABLE RUN_DIR [RUN_DIR ...]

Every step of the runs (real/POINT/run-K, or directories of them) is priced in context by TABLE, a table corrected
from those runs (`calibrate --from-runs`), beside the GPU temperature last sampled before it and the token bucket
the engine ran it at. For each term it prints each run's summed real / price - 1 without and with the term (RMS,
runs within 2%):
- temperature, in sample over the runs with telemetry: price x exp(slope x (T - the median T)), one slope per
  degree fitted on every step's log real / price, weighted by its price (the slope per step kind beside it);
  and the mean error per directory, without and with;
- bucket, held out by point (a point: a run's trace on its configuration, its repeats together): every prefill
  step's price x its bucket's summed real / price over that of its size class (costs.context.TOKEN_BUCKETS), fitted
  on the other points' steps, where a bucket has at least MIN_STEPS of them; and the factors fitted on every point.
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

from servecap.costs.context import MIN_STEPS, tokens_class
from servecap.costs.model import CostModel
from servecap.costs.recorded import contextual, priced_steps
from servecap.sim import inputs
from servecap.traces.command import Parser, command
from servecap.traces.records import read_run
from servecap.traces.telemetry import join_steps, read_telemetry


def priced(table: Path, runs: list[Path]) -> pd.DataFrame:
    cost = CostModel(inputs.load_table(table))
    out = []
    for d in runs:
        steps = priced_steps(read_run(d), cost)
        out.append(pd.DataFrame({
            "run": str(d), "point": f"{d.parent.parent.parent}/{d.parent.name}", "dir": str(d.parent.parent.parent),
            "step_kind": steps.step_kind, "real": steps.real_s, "price": np.asarray(contextual(steps, cost.correction)),
            "T": join_steps(steps[["start"]], read_telemetry(d)).temperature_c.to_numpy(),
            "bucket": cost.rounding.bucket(steps.tokens.to_numpy()),
            "size": [tokens_class(int(t)) for t in steps.tokens]}))
    return pd.concat(out, ignore_index=True)


def run_errors(df: pd.DataFrame, term: np.ndarray) -> tuple[pd.Series, pd.Series]:
    g = df.assign(with_term=df.price * term).groupby("run").agg(real=("real", "sum"), price=("price", "sum"),
                                                                  with_term=("with_term", "sum"))
    return g.real / g.price - 1, g.real / g.with_term - 1


def summary(before, after) -> str:
    before, after = np.asarray(before), np.asarray(after)
    return (f"RMS {np.sqrt(np.mean(before ** 2)):.2%} -> {np.sqrt(np.mean(after ** 2)):.2%}, within 2%: "
            f"{int((abs(before) <= 0.02).sum())} -> {int((abs(after) <= 0.02).sum())} of {len(before)}")


def slope(s: pd.DataFrame, ref: float) -> float:
    x, r, w = s["T"] - ref, np.log(s.real / s.price), s.price
    return float(np.sum(w * x * r) / np.sum(w * x * x))


def temperature(df: pd.DataFrame) -> None:
    df = df[df.run.isin(df.dropna(subset=["T"]).run.unique())].dropna(subset=["T"])
    ref = float(df["T"].median())
    print(f"temperature, in sample: {df.run.nunique()} runs with telemetry, median {ref:.0f} C")
    for kind, s in df.groupby("step_kind"):
        print(f"  slope, {kind:8s} {slope(s, ref) * 100:+.3f}% per C")
    b = slope(df, ref)
    before, after = run_errors(df, np.exp(b * (df["T"] - ref)).to_numpy())
    print(f"  slope, every step {b * 100:+.3f}% per C; each run's real / price - 1: {summary(before, after)}")
    by_dir = pd.DataFrame({"before": before, "after": after}).join(df.groupby("run").dir.first())
    for d, s in by_dir.groupby("dir"):
        print(f"  {d:36s} mean {s.before.mean():+.2%} -> {s.after.mean():+.2%}")


def bucket_factors(df: pd.DataFrame) -> pd.Series:
    p = df[df.step_kind == "prefill"]
    b = p.groupby("bucket").agg(real=("real", "sum"), price=("price", "sum"), n=("real", "size"),
                                size=("size", "first"))
    c = p.groupby("size").agg(real=("real", "sum"), price=("price", "sum"))
    f = (b.real / b.price) / (c.real / c.price).reindex(b["size"]).to_numpy()
    return f.where(b.n >= MIN_STEPS, 1.0)


def buckets(df: pd.DataFrame) -> None:
    before, after = [], []
    for point, held in df.groupby("point"):
        f = bucket_factors(df[df.point != point])
        term = np.where(held.step_kind == "prefill", held.bucket.map(f).fillna(1.0), 1.0)
        b, a = run_errors(held, term)
        before += list(b)
        after += list(a)
    print(f"bucket, held out by point: each run's real / price - 1: {summary(before, after)}")
    f = bucket_factors(df)
    print("  factors fitted on every point: " + ", ".join(f"{int(k)} {v:.3f}" for k, v in f.items() if v != 1.0))


@command("candidate_terms")
def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("table", type=Path)
    p.add_argument("runs", type=Path, nargs="+", help="run directories (real/POINT/run-K), or directories of them")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")  # extrapolation notes about a few long steps
    runs = sorted({m.parent for r in args.runs for m in ([r / "meta.json"] if (r / "meta.json").exists()
                                                        else r.glob("*/run-*/meta.json"))})
    df = priced(args.table, runs)
    temperature(df)
    buckets(df)
    return 0


if __name__ == "__main__":
    sys.exit(main())
