"""One plan's traffic on several GPUs, for a planner choosing one: per trace, the served rate and the TTFT p50 against
the arrival rate, each validation directory in its own colour, each prefill policy its own marker; filled, the
mean of the point's real runs (the directory's points.csv, from `validate report`); open, the directory's plan's
prediction, also at points not run. Directories of one plan's points (`validate plan --points-from`) on different
GPU kinds show what one kind serves against another at the same arrival rates.

Usage: python scripts/plot_gpu_kinds.py --out FIG.png [--force] VALIDATION_DIR ...
"""
from __future__ import annotations

import csv
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from servecap.traces.command import Parser, command  # noqa: E402
from servecap.traces.errors import InputError  # noqa: E402
from servecap.traces.outpath import check_new_file  # noqa: E402
from servecap.validate.points import load_plan  # noqa: E402

TRACES = {"azure-conv": "Azure conversation trace", "sharegpt": "ShareGPT"}
MARKERS = {"padded": "o", "packed": "s", "chunked": "^", "mixed": "D"}


def _trace(point_id: str) -> str | None:
    return next((t for t in TRACES if t in point_id), None)


def gathered(validation: Path) -> tuple[str, list[dict]]:
    """The directory's GPU (its plan table's device) and per public point: trace, policy, rate, and the predicted
    and (where run) measured served rate and TTFT p50 (ms)."""
    plan, points = load_plan(validation)
    csv_path = validation / "points.csv"
    if not csv_path.is_file():
        raise InputError(f"holds no points.csv; run `python -m validate report --out {validation}` first",
                         path=validation)
    with csv_path.open(newline="") as f:
        real = {r["point"]: r for r in csv.DictReader(f) if r["served_rate_real"]}
    rows = []
    for p in points:
        pred, trace = plan["predictions"].get(p.id), _trace(p.id)
        if pred is None or trace is None or p.serving.replicas > 1:
            continue
        r = real.get(p.id)
        rows.append({"trace": trace, "policy": p.serving.prefill.name, "rate": pred["rate"],
                     "served_sim": pred["served_rate"], "ttft_sim_ms": 1e3 * pred["ttft_p50"],
                     "served_real": float(r["served_rate_real"]) if r else None,
                     "ttft_real_ms": 1e3 * float(r["ttft_p50_real"]) if r else None})
    if not rows:
        raise InputError("plans no public-trace point of one engine", path=validation)
    return plan["table"]["device"], rows


def plot(by_dir: dict[str, tuple[str, list[dict]]], out: Path) -> None:
    traces = [t for t in TRACES if any(r["trace"] == t for _, rows in by_dir.values() for r in rows)]
    fig, axes = plt.subplots(2, len(traces), figsize=(6.2 * len(traces), 8.4), squeeze=False)
    # a colour a directory, so that two plans of one GPU (a closed and a serving refresh) are told apart too
    colours = dict(zip(by_dir, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for col, trace in enumerate(traces):
        served, ttft = axes[0, col], axes[1, col]
        for name, (_, rows) in by_dir.items():
            for r in (r for r in rows if r["trace"] == trace):
                marker = MARKERS.get(r["policy"], "x")
                predicted = {"facecolors": "none", "edgecolors": colours[name], "marker": marker, "s": 36}
                served.scatter(r["rate"], r["served_sim"], **predicted)
                ttft.scatter(r["rate"], r["ttft_sim_ms"], **predicted)
                if r["served_real"] is not None:
                    served.scatter(r["rate"], r["served_real"], color=colours[name], marker=marker, s=36)
                    ttft.scatter(r["rate"], r["ttft_real_ms"], color=colours[name], marker=marker, s=36)
        top = max(r["rate"] for _, rows in by_dir.values() for r in rows if r["trace"] == trace)
        served.plot([0, top], [0, top], ":", color="grey")
        served.set(title=f"{TRACES[trace]}: served rate", xlabel="arrival rate (req/s)", ylabel="served (req/s)")
        ttft.set(title=f"{TRACES[trace]}: TTFT p50", xlabel="arrival rate (req/s)", ylabel="TTFT p50 (ms)",
                 yscale="log")
        for ax in (served, ttft):
            ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], color=c, marker="o", linestyle="", label=f"{n} ({by_dir[n][0]})")
               for n, c in colours.items()]
    handles += [plt.Line2D([], [], color="black", marker=m, linestyle="", markerfacecolor="none", label=p)
                for p, m in MARKERS.items()]
    handles += [plt.Line2D([], [], color="grey", linestyle=":", label="served = offered"),
                plt.Line2D([], [], color="black", marker="o", linestyle="", label="measured (mean of the runs)"),
                plt.Line2D([], [], color="black", marker="o", linestyle="", markerfacecolor="none",
                           label="predicted (the directory's plan)")]
    axes[0, 0].legend(handles=handles, fontsize=8)
    fig.suptitle("Served rate and TTFT p50 by arrival rate, measured and predicted: " + ", ".join(
        f"{n} on {g}" for n, (g, _) in by_dir.items()), fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


@command("plot_gpu_kinds")
def main(argv: list[str] | None = None) -> int:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("validations", nargs="+", type=Path, metavar="DIR")
    ap.add_argument("--out", type=Path, required=True, help="the PNG to write")
    ap.add_argument("--force", action="store_true", help="replace an existing --out")
    args = ap.parse_args(argv)
    check_new_file(args.out, force=args.force)
    by_dir = {v.name: gathered(v) for v in args.validations}
    plot(by_dir, args.out)
    print(f"wrote {args.out}: " + ", ".join(f"{n} ({g}, {sum(r['served_real'] is not None for r in rows)} of "
                                            f"{len(rows)} points run)" for n, (g, rows) in by_dir.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
