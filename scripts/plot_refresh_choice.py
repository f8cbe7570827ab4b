"""Several plans of the same points against one set of real runs, per GPU session: each arrival point's TTFT p50
error (prediction over the mean of its repeats, as scripts/grade_validation.py grades it), a marker per plan, the
grade's target max(10%, the repeats' spread) shaded. Made to show whether refreshing a table on the GPU at hand
(closed shapes, a serving probe) predicted better than the table as it was (README, validations v32 and v34).

Usage: python scripts/plot_refresh_choice.py --out FIG.png [--force]
         --session RUNS_DIR LABEL=PLAN_DIR [LABEL=PLAN_DIR ...] [--session ...]
RUNS_DIR holds the real runs (real/POINT/run-K) and its own plan; each PLAN_DIR a committed plan of its points
(`validate plan --points-from`), RUNS_DIR itself for its own.
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grade_validation import against, planned, target  # noqa: E402

from servecap.traces.command import Parser, command  # noqa: E402
from servecap.traces.errors import InputError  # noqa: E402
from servecap.traces.outpath import check_new_file  # noqa: E402

MARKERS = ("o", "s", "D", "^", "v")


def errors(runs: Path, plans: dict[str, Path]) -> dict[str, list[tuple]]:
    """Per plan label, each arrival point's grade (grade_validation.target) against the runs in `runs` (the runs'
    own plan among them where RUNS_DIR is given as a PLAN_DIR)."""
    out = {}
    for label, plan_dir in plans.items():
        _, results, _ = planned(runs, against(runs, plan_dir))
        out[label] = [target(c) for c in results if c.point.trace.get("kind") != "closed-mixed"]
    return out


def plot(sessions: dict[str, dict[str, list[tuple]]], out: Path) -> None:
    labels = list(dict.fromkeys(label for by_plan in sessions.values() for label in by_plan))
    n = sum(len(next(iter(by_plan.values()))) for by_plan in sessions.values())
    fig, ax = plt.subplots(figsize=(max(8.0, 0.32 * n + 2), 5.2))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    x0, ticks = 0, []
    for session, by_plan in sessions.items():
        first = next(iter(by_plan.values()))
        for i, (pid, *_rest, spread, _ok) in enumerate(first):
            bound = 100 * max(0.10, spread)
            ax.fill_between([x0 + i - 0.4, x0 + i + 0.4], -bound, bound, color="grey", alpha=0.18, lw=0)
            ticks.append((x0 + i, pid))
        for j, label in enumerate(labels):
            rows = by_plan.get(label)
            if rows:
                ax.scatter([x0 + i for i in range(len(rows))], [100 * r[2] for r in rows], marker=MARKERS[j % 5],
                           color=colours[j % len(colours)], s=30, label=label, zorder=3)
        ax.axvline(x0 + len(first) - 0.5, color="grey", lw=0.6)
        ax.text(x0 + (len(first) - 1) / 2, 1.01, session, transform=ax.get_xaxis_transform(), ha="center",
                fontsize=8)
        x0 += len(first)
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xticks([t for t, _ in ticks], [p for _, p in ticks], rotation=90, fontsize=6)
    ax.set(ylabel="TTFT p50, prediction / mean of repeats - 1 (%)", xlim=(-0.6, x0 - 0.4))
    ax.set_title(f"TTFT p50 error per arrival point, {len(sessions)} GPU session(s) of real runs, each plan frozen "
                 "before them; shaded: max(10%, the repeats' spread)", fontsize=10, pad=16)
    handles, names = ax.get_legend_handles_labels()
    once = dict(zip(names, handles))  # a plan's label once, though each session draws it
    ax.legend(once.values(), once.keys(), fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)


@command("plot_refresh_choice")
def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--force", action="store_true", help="replace --out")
    p.add_argument("--session", nargs="+", action="append", required=True, metavar="ARG",
                   help="RUNS_DIR then LABEL=PLAN_DIR for each plan to grade against its runs")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")  # extrapolation notes about a few long steps
    check_new_file(args.out, force=args.force)
    sessions = {}
    for runs, *plans in args.session:
        if not plans or not all("=" in a for a in plans):
            raise InputError(f"--session {runs}: give LABEL=PLAN_DIR for each plan after the runs' directory")
        if not (Path(runs) / "plan.json").is_file():
            raise InputError("holds no plan.json", path=runs)
        sessions[Path(runs).name] = errors(Path(runs), {a.split("=", 1)[0]: Path(a.split("=", 1)[1]) for a in plans})
    plot(sessions, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
