"""Coverage of the prediction intervals: the share of real measurements inside their predicted band, over every
graded point and metric, with the bands' widths beside the real repeats' spread.

Blind where the plan froze its intervals (`validate plan --interval`); a plan without them can be graded
retrospectively, re-predicting the intervals from the same frozen table after the real runs (said as such: the
table did not see the runs, but the choice to look did).
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from servecap.sim.intervals import NAMES
from servecap.traces.csvio import atomic_write_text
from servecap.traces.errors import InputError
from servecap.traces.provenance import provenance

from .comparison import Compared, compare


def bands_for(plan: dict, results: list[Compared], table, level: float | None, out: Path) -> tuple[dict, dict]:
    """(bands by point id, what they are): the plan's frozen ones, else re-predicted at `level`."""
    if "intervals" in plan:
        iv = plan["intervals"]
        return iv["bands"], {"how": "blind: frozen in the plan before any real run", "level": iv["level"]}
    if level is None:
        raise InputError("the plan froze no intervals; pass --interval LEVEL to grade them retrospectively (from "
                         "the same frozen table, after the real runs)", path=Path(out) / "plan.json")
    from servecap.sim.intervals import Intervals

    from .plan import point_band
    iv = Intervals(table, level)
    bands = {c.point.id: point_band(iv, table, c.point, Path(out)) for c in results}
    return bands, {"how": "retrospective: re-predicted with intervals from the same frozen table after the real runs "
                          "(not blind)", "level": level, **{k: v for k, v in iv.describe().items() if k != "level"}}


def coverage(results: list[Compared], bands: dict) -> dict:
    """Inside / graded per metric and over all; each metric's median relative width (hi - lo) / predicted median;
    at near and past capacity points with repeats, the width over the repeats' own spread (max - min)."""
    per: dict[str, list[bool]] = {}
    widths: dict[str, list[float]] = {}
    versus_spread: list[dict] = []
    for c in results:
        for k, b in bands.get(c.point.id, {}).items():
            measured = [r[k] for r in c.real if isinstance(r.get(k), (int, float)) and math.isfinite(r[k])]
            if not measured:
                continue
            per.setdefault(k, []).extend(b["lo"] <= v <= b["hi"] for v in measured)
            widths.setdefault(k, []).append((b["hi"] - b["lo"]) / b["median"])
            if c.point.load in ("near", "past") and len(measured) > 1 and max(measured) > min(measured):
                versus_spread.append({"point": c.point.id, "metric": k, "width": b["hi"] - b["lo"],
                                      "real_spread": max(measured) - min(measured)})
    inside = sum(sum(v) for v in per.values())
    graded = sum(len(v) for v in per.values())
    return {"inside": inside, "graded": graded, "share": inside / graded if graded else math.nan,
            "metrics": {k: {"inside": sum(v), "graded": len(v), "median_rel_width": statistics.median(widths[k])}
                        for k, v in per.items()},
            "width_vs_real_spread": versus_spread}


def markdown(cov: dict, what: dict) -> list[str]:
    lines = [f"## Prediction intervals: coverage ({what['level']:g}%, {what['how']})", "",
             f"{cov['inside']} of {cov['graded']} real measurements inside their band ({cov['share']:.1%}).", "",
             "| metric | inside | median band width / prediction |", "|---|---|---|"]
    lines += [f"| {k} | {m['inside']} of {m['graded']} | {m['median_rel_width']:.0%} |" for k, m in cov["metrics"].items()]
    if cov["width_vs_real_spread"]:
        lines += ["", "Near and past capacity, band width against the real repeats' spread (max - min):", "",
                  "| point | metric | width | real spread | ratio |", "|---|---|---|---|---|"]
        for r in cov["width_vs_real_spread"]:
            _, unit, scale, spec = NAMES[r["metric"]]
            lines.append(f"| {r['point']} | {r['metric']} | {format(r['width'] * scale, spec)} {unit} | "
                         f"{format(r['real_spread'] * scale, spec)} {unit} | {r['width'] / r['real_spread']:.1f} |")
    return lines + [""]


def write(out: Path, table_path: Path | None, level: float | None, allow_nonstationary: bool = False,
          force: bool = False) -> Path:
    """coverage.md and coverage.json in the validation directory (report.md is left as it is)."""
    from servecap.sim import inputs

    out = Path(out)
    if (out / "coverage.md").exists() and not force:
        raise InputError("already holds a coverage report; pass --force to write it again", path=out / "coverage.md")
    plan, results = compare(out, table_path, allow_nonstationary)
    if not results:
        raise InputError("no real records to grade", path=out / "real")
    table = inputs.load_table(table_path, allow_nonstationary=allow_nonstationary)
    bands, what = bands_for(plan, results, table, level, out)
    cov = coverage(results, bands)
    atomic_write_text(out / "coverage.json", json.dumps({**what, **cov, "table_id": table.table_id, "bands": bands,
                                                        **provenance()}, indent=1, default=float) + "\n")
    atomic_write_text(out / "coverage.md", "\n".join([f"# Coverage of the prediction intervals: {out}", ""]
                                                     + markdown(cov, what)))
    return out / "coverage.md"
