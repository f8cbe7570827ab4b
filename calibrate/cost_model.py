"""The cost model: step durations for any shape, fitted to a cost table's measured points.

- Prefill (one admission group, `width` prompts padded to `padded_len`): a smooth surface from the engine's
  two regimes. Small groups are bound by the host launching some 340 kernels eagerly, a floor of about 10 ms
  on the H200 that grows a little with the group's rows; large ones by the GPU's work, linear in the padded
  tokens plus the attention square: g = base + per_token * width * len + per_token2 * width * len^2. The step
  costs the smooth maximum of the two, (floor^k + g^k)^(1/k), fitted with scipy's robust least squares on
  log time, so a noisy point bends the surface less than it would an interpolation through every point.
- Decode (one step of `rows` rows): the step a uniform batch would take at the longest row's length, less
  what the shorter rows save: t = uniform(rows, kv_max) - per_token * (rows * kv_max - kv_tokens). The
  uniform cost is measured at several lengths per row count and interpolated piecewise-linearly in the length
  (it rises steeply over the first thousand tokens and then flattens: no straight line fits it); per_token
  comes from the mixed-length runs by least squares (about zero for `padded`, which reads every row at the
  widest). Row counts between measured ones interpolate their neighbours.
- Overhead: the extra cost of a decode step per row it retires (their records are written then).
- Spread: the log-normal sigma of step times around the median, from the points' p10/p90, for the
  simulator's optional noise mode.
"""
from __future__ import annotations

import math
import warnings
from functools import lru_cache

import numpy as np
from scipy.optimize import least_squares, lsq_linear

from traces.errors import InputError

Z90 = 1.2815515655446004  # the 90th percentile of a standard normal


class ExtrapolationWarning(UserWarning):
    pass


def _sigma(points: list[dict]) -> float:
    """Median log-normal sigma implied by the points' p10/p90."""
    return float(np.median([math.log(p["p90_s"] / p["p10_s"]) / (2 * Z90) for p in points]))


PREFILL_PARAMS = ("floor_s", "floor_per_row_s", "base_s", "per_token_s", "per_token2_s", "sharpness")


def _prefill_time(params, width, padded_len):
    floor_s, floor_per_row_s, base_s, per_token_s, per_token2_s, k = params
    tokens = width * padded_len
    gpu = base_s + per_token_s * tokens + per_token2_s * tokens * padded_len
    floor = floor_s + floor_per_row_s * width
    top = np.maximum(floor, gpu)  # scaled by the larger term so that no power overflows
    return top * ((floor / top) ** k + (gpu / top) ** k) ** (1 / k)


def fit_prefill(points: list[dict]) -> dict:
    w = np.array([p["width"] for p in points], float)
    n = np.array([p["padded_len"] for p in points], float)
    y = np.array([p["median_s"] for p in points], float)
    big = np.argmax(w * n)
    # Start from the floor at the smallest shape and the throughput of the largest; positive through exp().
    x0 = np.log([y.min(), y.min() * 1e-3, y.min() * 0.05, y[big] / (w[big] * n[big]), y[big] / (w[big] * n[big] ** 2) * 0.05,
                 4.0])
    sharpness = ([-np.inf] * 5 + [0.0], [np.inf] * 5 + [np.log(50.0)])  # between a plain sum and a hard max
    res = least_squares(lambda x: np.log(_prefill_time(np.exp(x), w, n)) - np.log(y), x0, bounds=sharpness,
                        loss="soft_l1", f_scale=0.05)
    return {"method": "smooth-max", **dict(zip(PREFILL_PARAMS, np.exp(res.x).tolist())),
            "widths": [int(w.min()), int(w.max())], "lengths": [int(n.min()), int(n.max())], "sigma": _sigma(points)}


def fit_decode(points: list[dict]) -> dict:
    """Per row count: the uniform batches' cost against the length (knots), and the shorter rows' saving."""
    rows, knots, per_token = sorted({p["rows"] for p in points}), [], []
    for r in rows:
        pts = [p for p in points if p["rows"] == r]
        uniform = sorted((p for p in pts if p["kv_tokens"] == r * p["kv_max"]), key=lambda p: p["kv_max"])
        if not uniform:
            raise InputError(f"decode points for {r} rows have no uniform-length batch to anchor the model")
        # One knot per measured length: the median of the points at it (a long run gives several windows).
        lengths = sorted({p["kv_max"] for p in uniform})
        ks = [[m, float(np.median([p["median_s"] for p in uniform if p["kv_max"] == m]))] for m in lengths]
        knots.append(ks)
        mixed = [p for p in pts if p["kv_tokens"] < r * p["kv_max"]]
        if mixed:
            base = np.array([_interp(ks, p["kv_max"]) for p in mixed])
            short = np.array([r * p["kv_max"] - p["kv_tokens"] for p in mixed], float)
            y = np.array([p["median_s"] for p in mixed])
            # least squares on relative error of base - b * short = y, b >= 0
            per_token.append(float(lsq_linear((-short / y)[:, None], 1 - base / y, bounds=(0, np.inf)).x[0]))
        else:
            per_token.append(0.0)
    return {"rows": rows, "knots": knots, "per_token_s": per_token, "sigma": _sigma(points)}


def _interp(knots: list[list[float]], length):
    """Piecewise-linear in the length through the knots, extended along the end segments."""
    x = np.array([k[0] for k in knots], float)
    y = np.array([k[1] for k in knots], float)
    if len(x) == 1:
        return np.full_like(np.asarray(length, float), y[0])
    length = np.asarray(length, float)
    lo = y[0] + (length - x[0]) * (y[1] - y[0]) / (x[1] - x[0])
    hi = y[-1] + (length - x[-1]) * (y[-1] - y[-2]) / (x[-1] - x[-2])
    return np.where(length < x[0], lo, np.where(length > x[-1], hi, np.interp(length, x, y)))


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
        if p.get("method") != "smooth-max":
            raise InputError(f"cost table {table.get('table_id')} has a prefill fit of method {p.get('method')!r}; "
                             f"this version reads 'smooth-max': calibrate again with python -m calibrate")
        self._prefill_params = tuple(p[k] for k in PREFILL_PARAMS)
        self._widths, self._lengths = p["widths"], p["lengths"]
        self.prefill_sigma = p["sigma"]
        self._decode = f["decode"]
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
                          f"(the fitted model's own form)", ExtrapolationWarning,
                          stacklevel=3)

    def _prefill_cost(self, width: int, padded_len: int) -> float:
        """One admission group's prefill: `width` prompts padded to `padded_len`."""
        if width > self._widths[1] or padded_len > self._lengths[1]:
            self._outside(f"prefill width {width} x padded length {padded_len}")
        return float(_prefill_time(self._prefill_params, width, padded_len))

    def decode(self, backend: str, rows: int, kv_tokens, kv_max):
        """One decode step of `rows` rows holding `kv_tokens` K/V tokens in all, `kv_max` in the longest
        (numbers, or arrays of them for a stretch of steps)."""
        d = self._decode.get(backend)
        if d is None:
            raise InputError(f"the cost table has no decode costs for backend {backend!r} "
                             f"(it has {', '.join(self.backends)})")
        r = d["rows"]
        if rows > r[-1] or rows < r[0]:
            self._outside(f"decode rows {rows}")
        kv_tokens, kv_max = np.asarray(kv_tokens, float), np.asarray(kv_max, float)
        top = max(k[-1][0] for k in d["knots"])
        if np.max(kv_max) > 1.05 * top:
            self._outside(f"decode K/V of {int(np.max(kv_max))} tokens in the longest row")

        short = rows * kv_max - kv_tokens  # tokens the shorter rows lack next to a uniform batch at the longest

        def at(i: int):
            return _interp(d["knots"][i], kv_max) - d["per_token_s"][i] * short
        if len(r) == 1:
            return at(0)
        # Between two measured row counts, weigh their two predictions.
        i = int(np.clip(np.searchsorted(r, rows), 1, len(r) - 1))
        w = (rows - r[i - 1]) / (r[i] - r[i - 1])
        return at(i - 1) * (1 - w) + at(i) * w
