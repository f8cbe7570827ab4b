"""Where fresh engines differ: each run's decode steps against its point's fastest run, at the same shapes.

Fresh engines of one point on one GPU differ in speed by about 1% (the repeats' sd, run_to_run.json), and a run's
speed holds through it (grade_validation.py --segments). This splits a run's steps in three: decode steps inside a
stretch (launched ahead: the device's time alone), decode steps right after a prefill or fused step (each waits
for that step's result and for the host's launch), and prefill and fused steps (each waits for the host to plan
and launch it), and compares each with the same point's fastest run (the least summed busy time) at the same
shape (rows, and K/V tokens in 2048-token bins or positions in 256-token bins): the median over shapes of the ratio
of median durations. No cost table is involved. Prints a line per run and the spread of each part over all runs.

Usage: python scripts/instance_spread.py VALIDATION [VALIDATION ...]   (directories with real/POINT/run-K)
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd

from servecap.traces.command import Parser, command
from servecap.traces.records import is_complete, read_run

KV_BIN = 2048
TOKENS_BIN = 256
PARTS = ("inside", "after", "prefill")


def medians(run: Path) -> tuple[pd.Series, float]:
    """Median step duration by (part, rows, size bin): decode steps inside a stretch or right after a prefill
    (K/V tokens), prefill and fused steps (positions); and the run's busy time."""
    steps = read_run(run).steps
    dur = steps.end - steps.start
    decode = steps.kind == "decode"
    after = steps.kind.shift(1, fill_value="idle") != "decode"
    part = np.where(decode, np.where(after, "after", "inside"), "prefill")
    size = np.where(decode, steps.kv_tokens // KV_BIN, steps.tokens // TOKENS_BIN)
    return dur.groupby([part, steps.rows, size]).median(), float(dur.sum())


def ratio(a: pd.Series, b: pd.Series, part: str) -> float:
    if part not in a.index.get_level_values(0) or part not in b.index.get_level_values(0):
        return np.nan
    a, b = a.xs(part), b.xs(part)
    shared = a.index.intersection(b.index)
    return float(np.median(a[shared] / b[shared])) if len(shared) else np.nan


@command("instance_spread")
def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("validations", nargs="+", type=Path)
    args = p.parse_args(argv)
    rows = []
    for v in args.validations:
        for point in sorted((v / "real").iterdir()):
            runs = sorted(r for r in point.glob("run-*") if is_complete(r))  # an interrupted run is no repeat
            if len(runs) < 2:
                continue
            med = {r: medians(r) for r in runs}
            fastest = min(runs, key=lambda r: med[r][1])
            for r in runs:
                if r == fastest:
                    continue
                rows.append((f"{v.name}/{point.name}/{r.name}", med[r][1] / med[fastest][1],
                             *(ratio(med[r][0], med[fastest][0], part) for part in PARTS)))
    if not rows:
        print("no point with two or more runs", file=sys.stderr)
        return 2
    print("run, over its point's fastest run: busy time; decode steps inside a stretch; decode steps right after a "
          "prefill; prefill and fused steps")
    for name, busy, *parts in rows:
        print(f"  {name:70s} {busy:.3f}  " + "  ".join(f"{x:.4f}" for x in parts))
    t = pd.DataFrame(rows, columns=["run", "busy", *PARTS])
    print(f"{len(t)} runs: busy time median {t.busy.median():.3f} (max {t.busy.max():.3f}); " + "; ".join(
        f"{name} median {t[part].median():.4f} (range {t[part].min():.4f}-{t[part].max():.4f}, correlation with "
        f"busy time {t.busy.corr(t[part]):+.2f})"
        for part, name in zip(PARTS, ("decode inside a stretch", "decode right after a prefill",
                                      "prefill and fused steps"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
