"""The held-out check: the fitted cost model against steps measured at shapes the fit never saw.

Prefill: random widths and padded lengths off the grid, with the group's other prompts shorter, and the other
policies' steps (each chunk of a chunked prompt is a point). Decode: random
row counts with random prompt lengths per backend. The error of a point is predicted / measured - 1, with the
measured side the median of the run's repetitions (prefill) or usable steps (decode, predicted step by step).
"""
from __future__ import annotations

import numpy as np

from servecap.costs.model import CostModel

from .plan import Run
from .points import prefill_steps, usable_steps

TARGETS = {"median_abs_err": 0.03, "p95_abs_err": 0.10}
WORST = 5


def check(cost: CostModel, runs: list[Run], samples: dict[str, dict]) -> dict:
    points = []
    for run in runs:
        s = samples[run.key]
        if run.kind == "check-prefill":
            policy = run.policy.partition(":")[0]
            kind = "prefill" if policy == "padded" else f"prefill {policy}"
            for shape, dur in prefill_steps(run, s).items():  # a chunked prompt's chunks: one point each
                measured, predicted = float(np.median(dur)), cost.prefill(shape)
                points.append({"kind": kind, "run": run.label, "prompts": list(run.prompts),
                               "shape": [shape.rows, shape.tokens, shape.attn],
                               "measured_s": measured, "predicted_s": predicted, "error": predicted / measured - 1})
            continue
        kv_tokens, kv_max, dur = usable_steps(s)
        measured = float(np.median(dur))
        predicted = float(np.median(cost.decode(run.backend, run.width, kv_tokens, kv_max)))
        points.append({"kind": f"decode {run.backend}", "run": run.label, "prompts": list(run.prompts),
                       "measured_s": measured, "predicted_s": predicted, "error": predicted / measured - 1})
    summary = {}
    for kind in dict.fromkeys(p["kind"] for p in points):
        err = np.abs([p["error"] for p in points if p["kind"] == kind])
        s = {"n": int(err.size), "median_abs_err": float(np.median(err)), "p95_abs_err": float(np.percentile(err, 95)),
             "max_abs_err": float(err.max())}
        summary[kind] = {**s, "meets_targets": all(s[k] <= t for k, t in TARGETS.items())}
    return {"targets": TARGETS, "summary": summary, "points": points}


def report(acc: dict) -> str:
    """The check as a few lines of text: per kind against the targets, then the worst points."""
    t = acc["targets"]
    lines = [f"accuracy on held-out shapes (targets: median |error| <= {t['median_abs_err']:.0%}, "
             f"p95 <= {t['p95_abs_err']:.0%})"]
    for kind, s in acc["summary"].items():
        lines.append(f"  {kind:<15} n={s['n']:<3} median {s['median_abs_err']:6.1%}  p95 {s['p95_abs_err']:6.1%}  "
                     f"max {s['max_abs_err']:6.1%}  {'ok' if s['meets_targets'] else 'MISSES THE TARGETS'}")
    worst = sorted(acc["points"], key=lambda p: -abs(p["error"]))[:WORST]
    lines.append("  worst points:")
    lines += [f"    {p['run']:<34} measured {p['measured_s'] * 1e3:9.3f} ms  predicted {p['predicted_s'] * 1e3:9.3f} ms"
              f"  {p['error']:+7.1%}" for p in worst]
    return "\n".join(lines)
