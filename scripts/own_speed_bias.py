"""How far the simulator is from the engine when the cost level is exactly right: each run at its own speed.

Each complete run of each point of the validations' plans is simulated at its own speed (its summed step time over
the table's price for its steps in their serving context, as `validate noise` does) and log(measured / simulated)
is taken per metric. Per load (near, past) and prefill policy this prints the mean and the median of that log error
in percent and how many runs are above 0, for TTFT p50, queue wait p50 and served rate. Speed is taken out, so a
mean far from 0 over many runs is what the simulator's scheduling and timing get wrong, or what the runs' speed
within a run does (a run's speed is one number here), not what the step costs get wrong. (`validate replay` shows
the scheduling is the engine's: each run at its own recorded step times is reproduced exactly.)

Per load it also prints how the run's speed differs between its steps while a request waits (arrived, not yet
admitted) and the others, and with --sensitivity how far TTFT p50 moves per 1% of speed (each run simulated again
at its speed +-1%; the mean over the runs, since near capacity one run's TTFT p50 is not monotone in its speed):
the bias over that is the speed error it amounts to. With --before-prefill, what the decode step right before a
prefill (or fused) step holds over its price (the host's work at the pass's end, the device idle: the engine does not
launch a step ahead past an admissible arrival), per such step, and the bias when each run is simulated with that
time put on its prefill steps that follow a decode step, its other steps at the speed that keeps its total: the
in-sample check that led to the cost model's stretch-end term (a table fitted with it prices that time on the
step that holds it, so there the step holds about nothing over its price).

    python scripts/own_speed_bias.py --table T [--sensitivity] DIR [DIR ...]
"""
from __future__ import annotations

import math
import statistics
import sys
import warnings
from pathlib import Path

import numpy as np

from servecap.costs.context import IDLE_S, RETIRED
from servecap.costs.model import CostModel
from servecap.costs.recorded import contextual, priced_steps
from servecap.sim.inputs import load_table
from servecap.sim.intervals import scaled, scaled_table
from servecap.traces.command import Parser, command
from servecap.traces.errors import InputError
from servecap.traces.metrics import scored
from servecap.traces.records import read_run
from servecap.validate.noise import runs_by_point, speed_and_residuals
from servecap.validate.plan import point_simulation
from servecap.validate.points import load_plan

METRICS = ("ttft_p50", "queue_wait_p50", "served_rate")
STEP = 0.01  # the speed change --sensitivity simulates each run at, each way


def waiting_speeds(steps, price: np.ndarray, req) -> tuple[float, float]:
    """log of the run's speed over its steps that start while a request waits (arrived, not admitted), and over the
    others, each against its speed over all its steps (`steps` priced_steps' rows, `price` their contextual price,
    `req` the run's requests)."""
    real = steps.real_s.to_numpy()
    start = steps.start.to_numpy()
    waiting = (np.searchsorted(np.sort(req.arrival.to_numpy(float)), start, side="right")
               > np.searchsorted(np.sort(req.admitted.to_numpy(float)), start, side="right"))
    f = real.sum() / price.sum()

    def speed(m) -> float:
        return math.log(real[m].sum() / price[m].sum() / f) if m.any() else math.nan
    return speed(waiting), speed(~waiting)


class _PassEnd(CostModel):
    """A model that prices a prefill step after a decode step `extra_s` more: the pass's end before it."""

    def __init__(self, table, extra_s: float):
        super().__init__(table)
        self.extra_s = extra_s

    def prefill_in_context(self, shape, policy, prev_kind, idle_s, clock_mhz=None) -> float:
        d = super().prefill_in_context(shape, policy, prev_kind, idle_s, clock_mhz)
        return d + self.extra_s if prev_kind in ("decode", RETIRED) and idle_s < IDLE_S else d


def before_prefill(steps, price: np.ndarray) -> tuple[float, float]:
    """(seconds the decode steps right before a prefill or fused step hold over their price at the run's speed, per
    such step; the speed of the run's steps without that time), `steps` and `price` as for waiting_speeds."""
    real = steps.real_s.to_numpy()
    kind = steps.step_kind.to_numpy()
    f = real.sum() / price.sum()
    before = np.r_[(kind[:-1] == "decode") & (kind[1:] != "decode"), False]
    extra = float((real[before] - f * price[before]).sum())
    return extra / max(int(before.sum()), 1), (real.sum() - extra) / price.sum()


def residuals(validation: Path, table, sensitivity: bool = False,
              pass_end: bool = False) -> list[tuple[str, str, dict]]:
    """(load, prefill policy, log(measured / simulated at its own speed) by metric, with `waiting` and `others`
    (waiting_speeds), with `sensitivity` the change in log TTFT p50 per unit log speed, and with `pass_end` the
    pass's end before a prefill step (before_prefill) and TTFT p50's log error with it priced on that step) for
    every complete run of every arrival point of the validation's plan."""
    points = {p.id: p for p in load_plan(validation)[1]}
    cost = CostModel(table)
    out = []
    for pid, runs in runs_by_point(validation, min_runs=1).items():
        p = points.get(pid)
        if p is None or p.load not in ("near", "past"):
            continue
        recs = [read_run(r) for r in runs]
        speeds, res, _ = speed_and_residuals(validation, p, recs, table)
        if sensitivity or pass_end:
            trace, rate, run = point_simulation(p, validation)
        for f, r, rec in zip(speeds, res, recs):
            steps = priced_steps(rec, cost)  # once a run, for both
            price = contextual(steps, cost.correction)
            r["waiting"], r["others"] = waiting_speeds(steps, price, rec.requests)
            if sensitivity:
                slow, fast = (run(trace, scaled(table, f * (1 + d)))["ttft_p50"] for d in (STEP, -STEP))
                r["sensitivity"] = math.log(slow / fast) / math.log((1 + STEP) / (1 - STEP))
            if pass_end:
                extra, rest = before_prefill(steps, price)
                r["pass_end_s"] = extra
                r["ttft_p50_pass_end"] = math.log(scored(rec, rate)["ttft_p50"]
                                                  / run(trace, _PassEnd(scaled_table(table, rest), extra))["ttft_p50"])
            out.append((p.load, str(p.serving.prefill).partition(":")[0], r))
    return out


@command("own_speed_bias")
def main(argv: list[str] | None = None) -> int:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("validations", nargs="+", type=Path, metavar="DIR")
    ap.add_argument("--table", type=Path, required=True, help="the cost table that prices the runs' steps")
    ap.add_argument("--before-prefill", action="store_true",
                    help="also what the decode step before a prefill step holds over its price, and the bias with it "
                         "priced on the prefill step instead (in sample)")
    ap.add_argument("--sensitivity", action="store_true",
                    help=f"also simulate each run at its speed +-{100 * STEP:g}%%: how far TTFT p50 moves per 1%% of "
                         "speed")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    table = load_table(args.table)
    rows = [r for v in args.validations for r in residuals(v, table, args.sensitivity, args.before_prefill)]
    if not rows:
        raise InputError("no complete run at a near or past point")
    print("load  policy    runs | " + " | ".join(f"{m}: mean, median, above 0" for m in METRICS))
    for load in ("near", "past"):
        for policy in sorted({q for l, q, _ in rows if l == load}) + ["all"]:
            group = [r for l, q, r in rows if l == load and policy in (q, "all")]
            if not group:
                continue
            cells = []
            for m in METRICS:
                v = [r[m] for r in group if m in r]
                cells.append(f"{100 * statistics.mean(v):+5.1f}%, {100 * statistics.median(v):+5.1f}%, "
                             f"{sum(x > 0 for x in v):3d} of {len(v)}" if v else "-")
            print(f"{load:5s} {policy:8s} {len(group):5d} | " + " | ".join(cells))
    for load in ("near", "past"):
        group = [r for l, _, r in rows if l == load]
        if not group:
            continue
        waiting, others = (statistics.mean(v) for v in ([r[k] for r in group if math.isfinite(r[k])]
                                                        for k in ("waiting", "others")))
        line = (f"{load}: steps while a request waits run {100 * waiting:+.2f}% against the run's speed, the others "
                f"{100 * others:+.2f}%")
        if args.sensitivity:
            sens = statistics.mean(r["sensitivity"] for r in group)
            bias = statistics.mean(r["ttft_p50"] for r in group if "ttft_p50" in r)
            line += (f"; TTFT p50 moves {sens:.1f}% per 1% of speed (mean of runs), so its mean bias "
                     f"{100 * bias:+.1f}% is {100 * bias / sens:+.2f}% of speed")
        print(line)
        if args.before_prefill:
            print(f"{load}: the decode step before a prefill step holds " + ", ".join(
                f"{policy} {1e3 * statistics.mean(r['pass_end_s'] for l, q, r in rows if l == load and q == policy):.3f}"
                for policy in sorted({q for l, q, _ in rows if l == load})) + " ms over its price; priced on the "
                f"prefill step instead, TTFT p50's mean bias is "
                f"{100 * statistics.mean(r['ttft_p50_pass_end'] for r in group):+.1f}% (at the run's speed alone "
                f"{100 * statistics.mean(r['ttft_p50'] for r in group if 'ttft_p50' in r):+.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
