"""The prefill-policy report (results/predictions/report.md): for every policy point, the blind prediction (made
from a table of padded steps before the engine had the policy), the prediction from the re-calibrated table (which
measured the policy's own steps) and the measurement, side by side; the step costs each policy's real steps had
against both tables; and a figure.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from servecap.costs.model import CostModel
from servecap.costs.recorded import contextual, priced_steps
from servecap.sim import inputs
from servecap.traces.csvio import atomic_write_text
from servecap.traces.errors import InputError
from servecap.traces.records import read_run

from .points import run_dir
from .report import Compared, _fmt, _num, compare

KEYS = (("served_rate", "served req/s"), ("queue_wait_p50", "queue p50 s"), ("ttft_p95", "TTFT p95 s"),
        ("wall_time_s", "wall s"), ("gap_max", "largest gap s"))


def step_ratios(results: list[Compared], out: Path, tables: dict) -> dict:
    """Measured prefill and decode step times over each table's price at the same shape, per policy (prefill: the
    steps whose shape the record determines, servecap/costs/recorded.py)."""
    models = {name: CostModel(t) for name, t in tables.items()}
    got: dict[tuple[str, str, str], list[float]] = {}
    for c in results:
        rec = read_run(run_dir(out, c.point, 1))
        for name, cost in models.items():
            s = priced_steps(rec, cost)
            ratio = s.real_s / contextual(s, None)
            for kind, r in ratio.groupby(np.where(s.step_kind == "decode", "decode", "prefill")):
                got.setdefault((str(c.point.serving.prefill), kind, name), []).extend(r.tolist())
    return {k: float(np.median(v)) for k, v in got.items()}


def write(validation: Path, predictions: Path, table_path: Path, allow_nonstationary: bool = False,
          force: bool = False) -> Path:
    predictions = Path(predictions)
    if (predictions / "report.md").exists() and not force:
        raise InputError("already holds a report; pass --force to write it again", path=predictions / "report.md")
    plan, results = compare(Path(validation), table_path, allow_nonstationary)
    policy = [c for c in results if c.point.role == "policy"]
    if not policy:
        raise InputError("the validation has no graded policy points", path=validation)
    blind_table = inputs.load_table(predictions / "table.json") if (predictions / "table.json").exists() else \
        inputs.load_table(None)
    if blind_table.table_id != plan["blind"]["table"]["id"]:
        raise InputError(f"the blind predictions came from table {plan['blind']['table']['id']}; give it as "
                         f"{predictions / 'table.json'} or ship it", path=predictions)
    recal = inputs.load_table(table_path, allow_nonstationary=allow_nonstationary)
    ratios = step_ratios(policy, Path(validation), {"blind": blind_table, "re-calibrated": recal})
    lines = ["# Prefill policies: blind prediction, re-calibrated prediction, measurement", "",
             f"Blind: `python -m validate predict` from table {plan['blind']['table']['id']} (padded steps only), at "
             f"commit {plan['blind']['git_commit']}, before the engine ran packed or chunked prefill. Re-calibrated: "
             f"the plan's table {plan['table']['id']}, which measured every policy's steps. Measured: "
             f"{', '.join(sorted({r['device']['name'] for c in policy for r in c.meta}))}, "
             f"results/validation/real. Errors are (predicted - measured) / measured.", "",
             "| point | " + " | ".join(f"{label}: blind / re-cal / measured" for _, label in KEYS) + " |",
             "|---|" + "---|" * len(KEYS)]
    for c in policy:
        cells = []
        for k, _ in KEYS:
            m = c.measured.get(k)
            if m is None:
                cells.append("-")
                continue
            b, r = (c.blind or {}).get(k), c.sim.get(k)
            cells.append(f"{_fmt(b)} ({_fmt(c.err(k, c.blind) if c.blind else None, '+.0%')}) / {_fmt(r)} "
                         f"({_fmt(c.err(k), '+.0%')}) / {_fmt(m)}")
        lines.append(f"| {c.point.id} | " + " | ".join(cells) + " |")
    lines += ["", "## Steps in the real policy runs, measured over each table's model (median)", "",
              "| policy | step | blind table | re-calibrated table |", "|---|---|---|---|"]
    for policy_name in dict.fromkeys(str(c.point.serving.prefill) for c in policy):
        for kind in ("prefill", "decode"):
            b, r = ratios.get((policy_name, kind, "blind")), ratios.get((policy_name, kind, "re-calibrated"))
            if b is not None or r is not None:
                lines.append(f"| {policy_name} | {kind} | {_fmt(b)} | {_fmt(r)} |")
    _plot(policy, predictions / "policies.png")
    lines += ["", "![policies](policies.png)", ""]
    atomic_write_text(predictions / "report.md", "\n".join(lines))
    return predictions / "report.md"


def _plot(policy: list[Compared], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    device = policy[0].meta[0]["device"]["name"]
    names = list(dict.fromkeys(str(c.point.serving.prefill) for c in policy))
    fig, ax = plt.subplots(1, 3, figsize=(17, 4.8))
    for name in names:
        cs = sorted((c for c in policy if str(c.point.serving.prefill) == name and c.rate and c.point.trace["kind"] == "poisson"),
                    key=lambda c: c.rate)
        line, = ax[0].plot([c.rate for c in cs], [c.measured["served_rate"] for c in cs], "o-", label=f"{name}: {device}")
        ax[0].plot([c.rate for c in cs], [_num(c.sim["served_rate"]) for c in cs], "s--", mfc="none",
                   color=line.get_color(), label=f"{name}: re-calibrated prediction")
        ax[0].plot([c.rate for c in cs], [_num((c.blind or {}).get("served_rate")) for c in cs], "^:", mfc="none",
                   color=line.get_color(), label=f"{name}: blind prediction")
    ax[0].set(xlabel="arrival rate (req/s)", ylabel="served rate (req/s)",
              title="Served rate per prefill policy: measured, re-calibrated and blind predictions")
    ax[0].legend(fontsize=6)
    closed = [c for c in policy if not c.rate]
    x = np.arange(len(closed))
    for off, (label, get) in zip((-0.25, 0, 0.25), (("blind", lambda c: _num((c.blind or {}).get("wall_time_s"))),
                                                     ("re-calibrated", lambda c: _num(c.sim.get("wall_time_s"))),
                                                     (device, lambda c: c.measured["wall_time_s"]))):
        ax[1].bar(x + off, [get(c) for c in closed], 0.25, label=label)
    ax[1].set_xticks(x, [str(c.point.serving.prefill) for c in closed])
    ax[1].set(ylabel="wall time (s)", title="Closed mixed 32-row run per policy")
    ax[1].legend(fontsize=7)
    gaps = [c for c in policy if "gap_max" in c.measured]
    ax[2].scatter([c.measured["gap_max"] * 1e3 for c in gaps], [_num(c.sim.get("gap_max")) * 1e3 for c in gaps],
                  label="re-calibrated")
    ax[2].scatter([c.measured["gap_max"] * 1e3 for c in gaps], [_num((c.blind or {}).get("gap_max")) * 1e3 for c in gaps],
                  marker="^", label="blind")
    top = max(c.measured["gap_max"] for c in gaps) * 1e3 * 1.2
    ax[2].plot([0, top], [0, top], ":", color="grey")
    ax[2].set(xlabel=f"measured largest incumbent gap (ms, {device})", ylabel="predicted (ms)",
              title="Largest gap between an incumbent's tokens, every policy point")
    ax[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
