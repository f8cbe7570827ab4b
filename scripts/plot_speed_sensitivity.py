"""Near capacity, TTFT p50 against the engine's speed, one panel per point: the simulator's TTFT p50 with every step
priced at a speed factor from 0.97 to 1.03 of the table, and each real run at its own speed (its summed step time
over the table's price for its steps in their serving context, as `validate noise` measures it). The curve's slope
is how far a prediction moves per 1% of speed; a run above the curve at its own speed is what the simulator misses
there beyond the speed (scripts/own_speed_bias.py counts it over many runs).

Usage: python scripts/plot_speed_sensitivity.py --table T --out FIG.png [--force] VALIDATION_DIR ...
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from servecap.sim.inputs import load_table  # noqa: E402
from servecap.sim.intervals import scaled  # noqa: E402
from servecap.traces.command import Parser, command  # noqa: E402
from servecap.traces.errors import InputError  # noqa: E402
from servecap.traces.metrics import scored  # noqa: E402
from servecap.traces.outpath import check_new_file  # noqa: E402
from servecap.traces.records import read_run  # noqa: E402
from servecap.validate.noise import runs_by_point, speed_and_residuals  # noqa: E402
from servecap.validate.plan import point_simulation  # noqa: E402
from servecap.validate.points import load_plan  # noqa: E402

SPEEDS = np.linspace(0.97, 1.03, 25)


def curves(validations: list[Path], table) -> list[dict]:
    """Per near-capacity point: its label, the simulated TTFT p50 (ms) at each of SPEEDS, and each complete run's
    speed and TTFT p50 (ms)."""
    out = []
    for v in validations:
        points = {p.id: p for p in load_plan(v)[1]}
        for pid, runs in runs_by_point(v, min_runs=1).items():
            p = points.get(pid)
            if p is None or p.load != "near" or p.serving.replicas > 1:
                continue
            trace, rate, run = point_simulation(p, v)
            recs = [read_run(r) for r in runs]
            speeds, _, _ = speed_and_residuals(v, p, recs, table)
            out.append({"label": f"{v.name.removeprefix('validation-')} {pid}",
                        "sim_ms": [1e3 * run(trace, scaled(table, f))["ttft_p50"] for f in SPEEDS],
                        "runs": [(f, 1e3 * scored(rec, rate)["ttft_p50"]) for f, rec in zip(speeds, recs)]})
    return out


def plot(rows: list[dict], out: Path, table_id: str) -> None:
    cols = min(3, len(rows))
    lines = (len(rows) + cols - 1) // cols
    fig, axes = plt.subplots(lines, cols, figsize=(4.6 * cols, 3.6 * lines), squeeze=False)
    for ax, r in zip(axes.flat, rows):
        ax.plot(SPEEDS, r["sim_ms"], color="tab:blue", label="simulated at that speed")
        f, ttft = zip(*r["runs"])
        ax.scatter(f, ttft, color="tab:red", zorder=3, label="real run at its own speed")
        ax.set_title(r["label"], fontsize=9)
        ax.set_xlabel(f"engine time over table {table_id}'s price (1.01: 1% slower)", fontsize=8)
        ax.set_ylabel("TTFT p50 (ms)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(rows):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("Near capacity: TTFT p50 against the engine's speed (simulator's curve, real runs as points)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


@command("plot_speed_sensitivity")
def main(argv: list[str] | None = None) -> int:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("validations", nargs="+", type=Path, metavar="DIR")
    ap.add_argument("--table", type=Path, required=True, help="the cost table that prices the runs' steps")
    ap.add_argument("--out", type=Path, required=True, help="the PNG to write")
    ap.add_argument("--force", action="store_true", help="replace an existing --out")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    check_new_file(args.out, force=args.force)
    table = load_table(args.table)
    rows = curves(args.validations, table)
    if not rows:
        raise InputError("no complete run at a near-capacity point of one engine")
    plot(rows, args.out, table.table_id)
    print(f"wrote {args.out}: {len(rows)} points")
    return 0


if __name__ == "__main__":
    sys.exit(main())
