"""A GPU's prompt-step speed in serving, told before its runs by the SM clock its stationarity check left it at.

Near capacity a plan's TTFT misses follow the speed of the GPU's prompt steps (README, "Where the targets stand"),
and no reading taken before the runs has told that speed: the closed refresh's prefill shapes are too short for the
GPU to leave its top clock. A stationarity check runs prefill shapes long enough to hit the power limit, and reads
the SM clock after each repetition; a GPU that settles lower there may run its serving prompt steps slower.

`fit` reads each given validation's stationarity check (logs/stationary/check.txt: every session's check runs the
same shapes) and its prompt steps' speed (real / price in context, geometric mean over its runs, graded against its
own plan as scripts/plot_gpu_pool.py grades it), and fits log speed = intercept + slope x (clock - mean clock) by
least squares. `rescale` predicts a fresh GPU's prompt speed from its own check by that fit and writes the table
with its prefill points (and so its chunk and fused prices) rescaled by it, as `calibrate --refresh` writes a
refreshed table: planned before the runs, a blind test of the rule (results/validation-v48/README.md).

Usage: python scripts/post_burst_clock.py fit --out FIT.json [--force] VALIDATION [VALIDATION ...]
       python scripts/post_burst_clock.py rescale --check CHECK.txt --fit FIT.json --table T.json --out T2.json
"""
from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import sys
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plot_gpu_pool import gpu_grade  # noqa: E402

from servecap.calibrate.refresh import refreshed_from, rescaled  # noqa: E402
from servecap.costs.table import load_cost_table, save_cost_table  # noqa: E402
from servecap.traces.command import Parser, command  # noqa: E402
from servecap.traces.errors import InputError  # noqa: E402
from servecap.traces.outpath import check_new_file  # noqa: E402
from servecap.traces.provenance import git_commit, now_iso  # noqa: E402

# Prefill shapes of at least this many positions: long enough that the GPU reaches its power limit in them (smaller
# ones end at the top clock on every GPU).
MIN_POSITIONS = 20000
SHAPE = re.compile(r"^\s+stationarity prefill (\d+) x (\d+)\s+[\d.]+\s+(\[\[.*\]\])\s*$")


def post_burst_clock(check: Path) -> tuple[float, int]:
    """The mean SM clock read after each repetition of the check's prefill shapes of MIN_POSITIONS or more (the
    mean: NVML reports the clock in 15 MHz steps), and how many readings."""
    try:
        lines = check.read_text().splitlines()
    except OSError as e:
        raise InputError(f"cannot be read ({e.strerror})", path=check) from None
    after = [pair[1] for line in lines if (m := SHAPE.match(line)) and int(m[1]) * int(m[2]) >= MIN_POSITIONS
             for pair in json.loads(m[3])]
    if not after:
        raise InputError(f"holds no stationarity prefill shape of {MIN_POSITIONS} positions or more with its clocks "
                         "(the output of `python -m calibrate --check-stationary`)", path=check)
    return float(np.mean(after)), len(after)


def fitted(points: list[tuple[str, float, float]]) -> dict:
    """The least-squares line of log prompt speed on the post-burst clock over (session, clock, speed) points."""
    clock, speed = np.array([p[1] for p in points]), np.log([p[2] for p in points])
    slope, intercept = np.polyfit(clock - clock.mean(), speed, 1)
    residual = speed - (intercept + slope * (clock - clock.mean()))
    return {"mean_clock_mhz": float(clock.mean()), "intercept": float(intercept), "slope_per_mhz": float(slope),
            "correlation": float(np.corrcoef(clock, speed)[0, 1]),
            "residual_rms": float(np.sqrt(np.mean(residual ** 2))), "min_positions": MIN_POSITIONS,
            "sessions": [{"validation": v, "post_burst_clock_mhz": c, "prompt_speed": s} for v, c, s in points]}


def predicted(fit: dict, clock: float) -> float:
    """A GPU's prompt steps' real / price, told by its post-burst clock."""
    return float(np.exp(fit["intercept"] + fit["slope_per_mhz"] * (clock - fit["mean_clock_mhz"])))


def fit_command(args) -> int:
    check_new_file(args.out, force=args.force)
    for v in args.validations:
        if not (v / "plan.json").is_file() or not (v / "logs/stationary/check.txt").is_file():
            raise InputError("holds no plan.json and logs/stationary/check.txt", path=v)
    points = []
    for v in args.validations:
        clock, _ = post_burst_clock(v / "logs/stationary/check.txt")
        with contextlib.redirect_stdout(io.StringIO()):
            points.append((str(v), clock, gpu_grade(v)["prompt"]))
        print(f"{v.name:32s} post-burst clock {clock:7.1f} MHz  prompt steps' real / price {points[-1][2]:.4f}")
    if len(points) < 3:
        raise InputError(f"{len(points)} validations give no line to trust: fit needs three or more")
    fit = fitted(points)
    fit.update(made_at=now_iso(), git_commit=git_commit(), command=shlex.join(["python", *sys.argv]))
    args.out.write_text(json.dumps(fit, indent=1) + "\n")
    print(f"log speed = {fit['intercept']:+.5f} {fit['slope_per_mhz']:+.6f} x (clock - {fit['mean_clock_mhz']:.1f}) "
          f"over {len(points)} GPUs: correlation {fit['correlation']:+.2f}, residual RMS {fit['residual_rms']:.2%}")
    print(f"wrote {args.out}")
    return 0


def rescale_command(args) -> int:
    check_new_file(args.out, force=args.force, keep={"the table (--table)": args.table})
    try:
        fit = json.loads(args.fit.read_text())
        fit["intercept"], fit["slope_per_mhz"], fit["mean_clock_mhz"]
    except (OSError, ValueError, KeyError, TypeError):
        raise InputError("is not a fit written by `post_burst_clock.py fit`", path=args.fit) from None
    clock, n = post_burst_clock(args.check)
    old = load_cost_table(args.table)
    factor = predicted(fit, clock)
    table = rescaled(old.raw, {"prefill": factor})
    table.update(name=f"{old.raw['name']} (prompt steps rescaled by the post-burst clock)", created_at=now_iso(),
                 git_commit=git_commit(),
                 refreshed_from=refreshed_from(old),
                 refresh={"factors": {"prefill": factor}, "applied": {"prefill": factor},
                          "post_burst_clock_mhz": clock, "clock_readings": n, "check": str(args.check),
                          "fit": {"file": str(args.fit), "made_at": fit.get("made_at"),
                                  "sessions": len(fit.get("sessions", []))},
                          "command": shlex.join(["python", *sys.argv])})
    table.pop("table_id", None)
    tid = save_cost_table(table, args.out)
    print(f"post-burst clock {clock:.1f} MHz ({n} readings): prompt steps' real / price told {factor:.4f}; wrote "
          f"cost table {tid} to {args.out}")
    return 0


@command("post_burst_clock")
def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    f = sub.add_parser("fit", help="fit prompt speed on the post-burst clock over validations with their checks")
    f.add_argument("--out", type=Path, required=True, help="the fit (JSON)")
    f.add_argument("--force", action="store_true", help="replace --out")
    f.add_argument("validations", nargs="+", type=Path)
    r = sub.add_parser("rescale", help="a table's prompt steps rescaled to a GPU's speed told by its check")
    r.add_argument("--check", type=Path, required=True, help="the GPU's `calibrate --check-stationary` output")
    r.add_argument("--fit", type=Path, required=True, help="the fit (`fit --out`)")
    r.add_argument("--table", type=Path, required=True, help="the table to rescale")
    r.add_argument("--out", type=Path, required=True, help="the rescaled table")
    r.add_argument("--force", action="store_true", help="replace --out")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")  # extrapolation notes about a few long steps; the grading reads every step
    return fit_command(args) if args.what == "fit" else rescale_command(args)


if __name__ == "__main__":
    sys.exit(main())
