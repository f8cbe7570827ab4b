"""The cost model: step durations for any shape, fitted to a cost table's measured points.

- Prefill (one admission group): a smooth surface over group width x padded length, a cubic spline
  of log time in (log2 width, log2 padded length) through the measured grid points (of lower degree
  along an axis with fewer than 4 points). Prefill time bends from a launch-bound floor into linear and then quadratic
  (attention) growth; a linear interpolation between points a factor of 2 apart misses that bend by
  1-3%, the cubic by about 0.1% (tests/test_calibrate.py). Below the grid the cost is held at the
  smallest shape's; above it the surface is extended along its edge slope, with a warning.
- Decode (one step): for every measured row count, a line in the K/V tokens the attention reads
  (true lengths for `paged`, rows x widest for `padded`), fitted by least squares on relative error;
  row counts between measured ones interpolate the two lines.
- Overhead: the extra cost of a decode step that retires rows (their records are written then).
- Spread: the log-normal sigma of step times around the median, from the points' p10/p90, for the
  simulator's optional noise mode.
"""
from __future__ import annotations

import math
import warnings
from functools import lru_cache

import numpy as np
from scipy.interpolate import RectBivariateSpline
from scipy.optimize import lsq_linear

from traces.errors import InputError

Z90 = 1.2815515655446004  # the 90th percentile of a standard normal


class ExtrapolationWarning(UserWarning):
    pass


def _sigma(points: list[dict]) -> float:
    """Median log-normal sigma implied by the points' p10/p90."""
    return float(np.median([math.log(p["p90_s"] / p["p10_s"]) / (2 * Z90) for p in points]))


def fit_prefill(points: list[dict]) -> dict:
    widths = sorted({p["width"] for p in points})
    lengths = sorted({p["padded_len"] for p in points})
    grid = {(p["width"], p["padded_len"]): p["median_s"] for p in points}
    missing = [(w, n) for w in widths for n in lengths if (w, n) not in grid]
    if missing:
        raise InputError(f"prefill points must form a full width x length grid; missing {missing[:5]}")
    log_s = [[math.log(grid[w, n]) for n in lengths] for w in widths]
    return {"widths": widths, "lengths": lengths, "log_s": log_s, "method": "cubic", "sigma": _sigma(points)}


def fit_decode(points: list[dict]) -> dict:
    """Per row count, t = intercept + per_token * kv_read, minimising relative error."""
    rows = sorted({p["rows"] for p in points})
    intercept, per_token, kv_lo, kv_hi = [], [], [], []
    for r in rows:
        pts = [p for p in points if p["rows"] == r]
        x = np.array([p["kv_read"] for p in pts], float)
        y = np.array([p["median_s"] for p in pts], float)
        if len(pts) == 1:
            a, b = y[0], 0.0
        else:
            sol = lsq_linear(np.stack([1 / y, x / y], axis=1), np.ones_like(y), bounds=([0, 0], [np.inf, np.inf]))
            a, b = sol.x
        intercept.append(float(a))
        per_token.append(float(b))
        kv_lo.append(int(x.min()))
        kv_hi.append(int(x.max()))
    return {"rows": rows, "intercept_s": intercept, "per_token_s": per_token, "kv_read_min": kv_lo,
            "kv_read_max": kv_hi, "sigma": _sigma(points)}


def fit(table: dict) -> dict:
    """The `fit` section for a table's measured points."""
    return {"prefill": fit_prefill(table["prefill"]["points"]),
            "decode": {b: fit_decode(d["points"]) for b, d in table["decode"].items()}}


class CostModel:
    """Step durations in seconds from a validated cost table's fit."""

    def __init__(self, table: dict, strict: bool = False):
        self.table = table
        self.strict = strict
        f = table["fit"]
        p = f["prefill"]
        self._widths, self._lengths = np.array(p["widths"], float), np.array(p["lengths"], float)
        axes, log_s = [np.log2(self._widths), np.log2(self._lengths)], np.array(p["log_s"], float)
        for i in (0, 1):  # a single measured width or length (max batch 1): the surface is flat along that axis
            if len(axes[i]) == 1:
                axes[i] = np.append(axes[i], axes[i][0] + 1)
                log_s = np.concatenate([log_s, log_s], axis=i)
        self._axes = axes
        # An interpolating spline (s=0) passes through every measured point. Tables written before the fit
        # recorded its method were linear.
        k = [min(3, len(a) - 1) if p.get("method") == "cubic" else 1 for a in axes]
        self._prefill = RectBivariateSpline(*axes, log_s, kx=k[0], ky=k[1], s=0)
        self.prefill_sigma = p["sigma"]
        self._decode = {b: {k: np.array(v, float) for k, v in d.items() if k != "sigma"}
                        for b, d in f["decode"].items()}
        self.decode_sigma = {b: d["sigma"] for b, d in f["decode"].items()}
        self.retire_s = float(table.get("overhead", {}).get("retire_s", 0.0))
        self.backends = tuple(self._decode)
        self._warned: set[str] = set()
        self.prefill = lru_cache(maxsize=65536)(self._prefill_cost)

    def _outside(self, what: str) -> None:
        if self.strict:
            raise InputError(f"{what} is outside the cost table's measured range (strict mode)")
        key = what.split(" ")[0]
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"{what} is outside the cost table's measured range; extrapolating "
                          f"(log-linear along the edge for prefill, linearly for decode)", ExtrapolationWarning,
                          stacklevel=3)

    def _prefill_cost(self, width: int, padded_len: int) -> float:
        """One admission group's prefill: `width` prompts left-padded to `padded_len`."""
        if width > self._widths[-1] or padded_len > self._lengths[-1]:
            self._outside(f"prefill width {width} x padded length {padded_len}")
        # Smaller than the smallest measured shape: launch-bound, costs what that shape costs.
        x = math.log2(max(float(width), self._widths[0]))
        y = math.log2(max(float(padded_len), self._lengths[0]))
        (xs, ys), f = self._axes, self._prefill.ev
        xc, yc = min(x, xs[-1]), min(y, ys[-1])
        log_s = f(xc, yc)
        # Beyond the grid a spline's own extrapolation can swing anywhere: extend the edge's slope instead.
        if x > xs[-1]:
            log_s += (x - xs[-1]) * (f(xs[-1], yc) - f(xs[-2], yc)) / (xs[-1] - xs[-2])
        if y > ys[-1]:
            log_s += (y - ys[-1]) * (f(xc, ys[-1]) - f(xc, ys[-2])) / (ys[-1] - ys[-2])
        return float(np.exp(log_s))

    def decode(self, backend: str, rows: int, kv_read):
        """One decode step of `rows` rows reading `kv_read` K/V tokens (a number or an array of them)."""
        d = self._decode.get(backend)
        if d is None:
            raise InputError(f"the cost table has no decode costs for backend {backend!r} "
                             f"(it has {', '.join(self.backends)})")
        r = d["rows"]
        if rows > r[-1] or rows < r[0]:
            self._outside(f"decode rows {rows}")
        if len(r) == 1:
            a, b, hi = d["intercept_s"][0], d["per_token_s"][0], d["kv_read_max"][0]
        else:  # interpolate the two neighbouring row counts' lines (extend the end ones outside)
            i = int(np.clip(np.searchsorted(r, rows), 1, len(r) - 1))
            w = (rows - r[i - 1]) / (r[i] - r[i - 1])
            a = d["intercept_s"][i - 1] * (1 - w) + d["intercept_s"][i] * w
            b = d["per_token_s"][i - 1] * (1 - w) + d["per_token_s"][i] * w
            hi = max(d["kv_read_max"][i - 1], d["kv_read_max"][i])
        if np.max(kv_read) > 1.05 * hi:
            self._outside(f"decode K/V read {int(np.max(kv_read))} tokens at {rows} rows")
        return a + b * kv_read
