"""The planner's workflow graded blind, one figure: for each point of the validations given (each a plan made from a
table corrected from earlier serving runs and refreshed on the GPU that then ran it), the prediction and its 90%
band against the mean of the real repeats, each repeat beside it, for served rate and TTFT p50, with the targets'
limits (served within 2%; TTFT within 10%, or the repeats' spread where wider).

Usage: python scripts/plot_workflow.py --out FIG.png VALIDATION_DIR ...
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from servecap.traces.command import Parser, command  # noqa: E402
from servecap.validate.comparison import compare, plan_table  # noqa: E402

METRICS = (("served_rate", "served rate", 0.02), ("ttft_p50", "TTFT p50", 0.10))


def points(validations: list[Path]) -> list[dict]:
    """Per arrival point: its label, and per metric the real repeats, the prediction and the band, each over the
    repeats' mean."""
    out = []
    for v in validations:
        plan, results = compare(v, plan_table(v))
        bands = plan["intervals"]["bands"]
        for c in results:
            name = v.name.removeprefix("validation-").removesuffix("-shapes").replace("-", " ", 1)
            row = {"label": f"{name} {c.point.id}", "validation": name.split()[0]}
            for k, _, _ in METRICS:
                real = np.array([m[k] for m in c.real], float)
                mean, b = real.mean(), bands[c.point.id][k]
                row[k] = {"real": real / mean - 1, "pred": c.sim[k] / mean - 1, "lo": b["lo"] / mean - 1,
                          "hi": b["hi"] / mean - 1, "spread": (real.max() - real.min()) / np.median(real)}
            out.append(row)
    return out


def plot(rows: list[dict], out: Path) -> None:
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 0.42 * len(rows)), 8), sharex=True)
    x = np.arange(len(rows))
    for ax, (k, name, limit) in zip(axes, METRICS):
        pred = np.array([r[k]["pred"] for r in rows]) * 100
        lo = np.array([r[k]["lo"] for r in rows]) * 100
        hi = np.array([r[k]["hi"] for r in rows]) * 100
        seen = False  # the spread's legend entry, once
        ax.vlines(x, lo, hi, color="tab:blue", alpha=0.35, lw=6, label="90% band")
        ax.plot(x, pred, "o", color="tab:blue", label="prediction")
        for i, r in enumerate(rows):
            ax.plot(np.full(len(r[k]["real"]), i), r[k]["real"] * 100, "_", color="black", ms=10,
                    label="each real run" if i == 0 else None)
            if k == "ttft_p50" and r[k]["spread"] > limit:  # the TTFT limit is the repeats' spread here
                for s in (-1, 1):
                    ax.plot([i - 0.3, i + 0.3], [s * r[k]["spread"] * 100] * 2, color="tab:orange", lw=1.5,
                            label="the repeats' spread, where above 10%" if s == 1 and not seen else None)
                seen = True
        ax.axhline(0, color="grey", lw=0.8)
        for s in (-1, 1):
            ax.axhline(s * limit * 100, color="tab:red", ls="--", lw=1,
                       label=f"target +/-{limit:.0%}" if s == 1 else None)
        ax.set_ylabel(f"{name}, % off the real runs' mean")
        ax.legend(loc="upper left", fontsize=8, ncol=4)
    axes[-1].set_xticks(x, [r["label"] for r in rows], rotation=75, ha="right", fontsize=7)
    names = sorted({r["validation"] for r in rows}, key=lambda v: int(v[1:]))
    engines = sorted({len(r["served_rate"]["real"]) for r in rows})
    runs = f"{engines[0]}" if len(engines) == 1 else f"{engines[0]}-{engines[-1]}"
    fig.suptitle(f"Blind predictions from tables corrected from earlier serving runs and refreshed on the GPU at hand:\n"
                 f"{len(rows)} points of validations {names[0]}-{names[-1]}, each point on {runs} fresh engines "
                 f"({sum(len(r['served_rate']['real']) for r in rows)} runs)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=130)


@command("plot_workflow")
def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("validations", type=Path, nargs="+")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    plot(points(args.validations), args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
