"""Where the issues' targets stand on every fresh GPU: each GPU kind's blind validations pooled, each session graded
against the plan frozen before its runs, from its table as it is (a session planned from a refreshed table against
the unrefreshed plan its points came from: scripts/grade_validation.py --unrefreshed). Writes each kind's grading in
full to OUT/KIND.txt, and the README's table of the targets to OUT/targets.md and stdout.

Usage: python scripts/targets.py [--out DIR] [--force]

A new session joins its kind's pool in POOLS once its runs are graded; stationarity and the audit's items are not
graded from runs, and the README states them beside this table.
"""
from __future__ import annotations

import contextlib
import io
import statistics
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grade_validation import Graded, grade_all, shared_band_ratios, target_counts, unrefreshed  # noqa: E402

from servecap.traces.command import Parser, command  # noqa: E402
from servecap.traces.outpath import check_new_file  # noqa: E402

# The README's pools, each a fresh GPU session graded blind against a plan from a table corrected from serving runs:
# on H100s v28 on (v27 planned from its own closed-run table); on H200s v12-v27 (the sessions that refreshed such a
# table on their GPU, graded against the unrefreshed plan) and v35.
POOLS = {
    "h100": ("v28-87507692", "v29-2304fc8c", "v30-0d00527b", "v32-5d7577b0", "v37-89c098b0", "v39-0849f914",
             "v39-24c9ce4e", "v39-c46ecc40", "v39-3b82dd1f", "v39-7474a88c", "v39-68f6b1d8", "v39-1982e955",
             "v39-b710c8e5", "v39-82c13fd9", "v39-55afac86", "v39-0ce5140e", "v39-5a9d83e6", "v39-d4b00ef3",
             "v39-93b9ceef", "v39-15219234", "v39-eb110102", "v39-cc7f0c14", "v39-91f89b91"),
    "h200": ("v12-75aa3e01", "v12-ffe95ba0", "v13-238c0f96", "v14-84a7ee4b-shapes", "v14-8ae6270d-shapes",
             "v15-7a65ac6b", "v16-71520d56", "v17-8949485d", "v17-e519c7cb", "v18-b75ac2b2", "v19-b74d99e5",
             "v19-eb5f71c2", "v20-0a4e91e3", "v20-673ad031", "v20-673ad031c", "v21-531a50bd", "v21-e1a3ea2e",
             "v22-e1a3ea2e", "v22-e1a3ea2eb", "v23-320e841d", "v23-9e9050df", "v24-ecfaa693", "v25-48fe290a",
             "v26-b04010c1", "v27-778ea5af", "v35-557690b6")}
COVER = 0.85  # the share of measurements a 90% band must hold


def column(graded: dict[Path, Graded]) -> dict[str, str]:
    """One kind's cell per target: its count met of all, over the pooled sessions."""
    counts = {k: f"{met} of {of}" for k, (met, of) in target_counts(graded).items()}
    bands = [g.bands["all"] for g in graded.values()]
    inside, measured = sum(b["inside"] for b in bands), sum(b["graded"] for b in bands)
    under = sum(b["inside"] < COVER * b["graded"] for b in bands if b["graded"])
    near = [w["width"] / w["real_spread"] for g in graded.values() for w in g.bands["near"]["width_vs_real_spread"]]
    gpus = shared_band_ratios({v: g.compared for v, g in graded.items()})["near"][1]
    return {**counts,
            "bands": f"{inside} of {measured} ({inside / measured:.1%}); sessions under {COVER:.0%}: {under} of "
                     f"{len(graded)}",
            "width": _within_twice(near), "width_gpus": _within_twice(gpus)}


def _within_twice(ratios: list[float]) -> str:
    return f"{sum(r <= 2 for r in ratios)} of {len(ratios)} (median {statistics.median(ratios):.1f}x)" if ratios \
        else "none run on several GPUs"


ROWS = (("served", "served rate within 2%, every public-trace point"),
        ("ttft", "TTFT p50 within max(10%, the repeats' spread)"),
        ("runs", "each run's summed step time within 2%"),
        ("kinds", "median real / price within 2%, each step kind in each session"),
        ("bands", f"90% bands hold {COVER:.0%} of the measurements"),
        ("width", "band width near capacity within 2x the repeats' spread"),
        ("width_gpus", "band width near capacity within 2x the spread of every GPU's runs, at the points one plan "
                       "ran on several GPUs"))


def table(columns: dict[str, tuple[int, dict[str, str]]]) -> list[str]:
    """The markdown table: a row per target, a column per kind (its session count in the header)."""
    head = "| target | " + " | ".join(f"{kind.upper()}: {n} sessions" for kind, (n, _) in columns.items()) + " |"
    return [head, "|---" * (len(columns) + 1) + "|",
            *(f"| {label} | " + " | ".join(c[key] for _, c in columns.values()) + " |" for key, label in ROWS)]


@command("targets")
def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("results/targets"), help="where each kind's grading and the "
                   "table go (default: results/targets)")
    p.add_argument("--force", action="store_true", help="replace the files in --out")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")  # extrapolation notes about a few long steps; the grading reads every step
    outs = [args.out / f"{kind}.txt" for kind in POOLS] + [args.out / "targets.md"]
    for out in outs:
        check_new_file(out, force=args.force)
    columns, gradings = {}, {}
    for kind, names in POOLS.items():
        print(f"grading {len(names)} {kind.upper()} sessions", file=sys.stderr)
        with contextlib.redirect_stdout(io.StringIO()) as gradings[kind]:
            graded = grade_all([Path("results") / f"validation-{name}" for name in names], unrefreshed)
        columns[kind] = (len(graded), column(graded))
    lines = table(columns)
    args.out.mkdir(parents=True, exist_ok=True)
    for kind, text in gradings.items():
        (args.out / f"{kind}.txt").write_text(text.getvalue())
    outs[-1].write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
