"""Blind plans on many GPUs of a kind: each GPU's own speed against what its plan missed there. For each validation
given (the real runs of a plan in one GPU session: v39's one plan on eighteen H100s, or the H200 pool's 26 sessions,
each with its own plan), x is the speed of its prompt steps (the geometric mean over its runs of their prefill, chunk
and fused steps' summed real / price in context, as scripts/grade_validation.py grades them), and the panels give
each arrival point's TTFT p50 error near capacity and served rate error past capacity (a miss filled, the targets'
limits drawn) and the share of its measurements inside the plan's 90% bands. Made to show whether what a plan misses
follows the GPU it ran on.

Usage: python scripts/plot_gpu_pool.py --out FIG.png [--force] VALIDATION [VALIDATION ...]
"""
from __future__ import annotations

import contextlib
import io
import json
import sys
import warnings
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grade_validation import grade, target  # noqa: E402

from servecap.traces.command import Parser, command  # noqa: E402
from servecap.traces.errors import InputError  # noqa: E402
from servecap.traces.outpath import check_new_file  # noqa: E402


def gpu_grade(validation: Path) -> dict:
    """One validation's speeds by kind of step (geometric means over its runs), its arrival points' grades
    (grade_validation.target) with their load, and its bands' coverage over every point."""
    with contextlib.redirect_stdout(io.StringIO()):  # grade prints the README's grading; the figure needs its values
        graded = grade(validation)
    runs, by_load = graded.runs, graded.bands
    points = [(c.point.load, *target(c)) for c in graded.compared[0] if c.point.trace.get("kind") != "closed-mixed"]
    return {"table": json.loads((validation / "plan.json").read_text())["table"]["id"],
            "prompt": float(np.exp(np.log(runs.prefill.dropna()).mean())),
            "decode": float(np.exp(np.log(runs.decode.dropna()).mean())),
            "points": points, "inside": by_load["all"]["inside"], "graded": by_load["all"]["graded"]}


def summary(grades: dict[str, dict]) -> list[str]:
    """Per GPU, slowest prompt steps last: its speeds, the mean near-capacity TTFT p50 error and past-capacity
    served error, the bands' coverage; and how the near TTFT error follows the prompt steps' speed."""
    lines = [f"{'validation':28s} {'prompt':>7s} {'decode':>7s} {'near TTFT':>10s} {'past served':>12s} {'bands':>14s}"]
    near = []
    for v, g in sorted(grades.items(), key=lambda kv: kv[1]["prompt"]):
        ttft = [p[3] for p in g["points"] if p[0] == "near"]
        served = [p[2] for p in g["points"] if p[0] == "past"]
        if ttft:
            near.append((g["prompt"], float(np.mean(ttft))))
        cells = [f"{np.mean(x):+.1%}" if x else "-" for x in (ttft, served)]
        lines.append(f"{v:28s} {g['prompt']:7.3f} {g['decode']:7.3f} {cells[0]:>10s} {cells[1]:>12s} "
                     f"{g['inside']:5d}/{g['graded']:<4d} {g['inside'] / max(g['graded'], 1):5.1%}")
    if len(near) > 2:
        x, y = np.log([n[0] for n in near]), [n[1] for n in near]
        slope = np.polyfit(x, y, 1)[0]
        lines.append(f"near-capacity TTFT p50 error against the prompt steps' log speed over {len(near)} GPU sessions: "
                     f"correlation {np.corrcoef(x, y)[0, 1]:+.2f}, {slope / 100:+.1%} per 1% slower")
    return lines


def plot(grades: dict[str, dict], out: Path, title: str) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    for ax, load, at, limit, label, rule in (
            (axes[0], "near", 3, 0.10, "TTFT p50 near capacity", "missed: outside max(10%, its repeats' spread)"),
            (axes[1], "past", 2, 0.02, "served rate past capacity", "missed: outside 2%")):
        for g in grades.values():
            rows = [p for p in g["points"] if p[0] == load]
            x = 100 * (g["prompt"] - 1)
            for p in rows:
                ok = p[5] if at == 3 else abs(p[2]) <= limit
                ax.scatter(x, 100 * p[at], s=22, facecolors="none" if ok else "tab:red",
                           edgecolors="tab:blue" if ok else "tab:red", zorder=3)
            if rows:
                ax.scatter(x, 100 * np.mean([p[at] for p in rows]), marker="_", s=220, color="black", zorder=4)
        ax.axhspan(-100 * limit, 100 * limit, color="grey", alpha=0.15, lw=0)
        ax.axhline(0, color="black", lw=0.6)
        ax.set(xlabel="the GPU's prompt steps, real / price - 1 (%)", ylabel=f"{label}: prediction / real - 1 (%)")
        ax.set_title(f"{label}, each point; shaded: {limit:.0%}; bar: the GPU's mean\nfilled: {rule}", fontsize=8)
        ax.grid(alpha=0.3)
    ax = axes[2]
    for g in grades.values():
        ax.scatter(100 * (g["prompt"] - 1), 100 * g["inside"] / max(g["graded"], 1), s=12 + g["graded"] / 4,
                   color="tab:blue" if g["inside"] >= 0.85 * g["graded"] else "tab:red", zorder=3)
    ax.axhline(85, color="tab:red", lw=0.8, ls="--", label="target 85%")
    ax.axhline(90, color="grey", lw=0.8, ls=":", label="the bands' level 90%")
    ax.set(xlabel="the GPU's prompt steps, real / price - 1 (%)", ylabel="measurements inside the 90% bands (%)")
    ax.set_title("each GPU's band coverage, every metric of every run\n(dot area: measurements graded)", fontsize=8)
    ax.legend(fontsize=8, loc="best")
    ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)


@command("plot_gpu_pool")
def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--force", action="store_true", help="replace --out")
    p.add_argument("validations", nargs="+", type=Path)
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")  # extrapolation notes about a few long steps
    check_new_file(args.out, force=args.force)
    for v in args.validations:
        if not (v / "plan.json").is_file() or not (v / "real").is_dir():
            raise InputError("holds no plan.json and real/ runs", path=v)
    grades = {}
    for i, v in enumerate(args.validations, 1):
        print(f"grading {v} ({i} of {len(args.validations)})", file=sys.stderr)
        grades[v.name] = gpu_grade(v)
    tables = sorted({g["table"] for g in grades.values()})
    made = f"table {tables[0]}" if len(tables) == 1 else f"{len(tables)} tables (each validation's own plan)"
    print("\n".join(summary(grades)))
    plot(grades, args.out, f"blind predictions from {made} in {len(grades)} GPU session(s), each session's real runs "
                           "against its GPU's own prompt-step speed")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
