"""Fitting a cost table's model (costs/model.py) to its measured points, with scipy's robust least squares.

Calibration fits the tables it writes; synthetic tables are fitted the same way, so they exercise the same path.
The simulator only evaluates a fit, and never imports this module.
"""
from __future__ import annotations

import math

import numpy as np
from scipy.optimize import least_squares, lsq_linear

from traces.errors import InputError

from .model import PrefillRounding, interp, prefill_time
from .shapes import PrefillShape
from .table import PREFILL_PARAMS

Z90 = 1.2815515655446004  # the 90th percentile of a standard normal


def sigma(points: list[dict]) -> float:
    """Median log-normal sigma implied by the points' p10/p90."""
    return float(np.median([math.log(p["p90_s"] / p["p10_s"]) / (2 * Z90) for p in points]))


def point_shape(p: dict) -> PrefillShape:
    """A prefill point's step: its sequences when it lists them, else a padded group (rows x tokens / rows)."""
    if "computed" in p:
        return PrefillShape.of(p["computed"], p.get("prefix"))
    return PrefillShape.padded(p["rows"], p["tokens"] // p["rows"])


def fit_prefill(points: list[dict], engine: dict | None = None) -> dict:
    """The smooth-max surface over prefill points (costs/model.py), with the engine's rounding when known."""
    rounding = PrefillRounding(engine)
    feats = [rounding.features(point_shape(p)) for p in points]
    rows = np.array([p["rows"] for p in points], float)
    tokens = np.array([f[0] for f in feats], float)
    span = np.array([f[1] for f in feats], float)
    y = np.array([p["median_s"] for p in points], float)
    big = np.argmax(tokens)
    # Start from the floor at the smallest shape and the throughput of the largest; positive through exp().
    x0 = np.log([y.min(), y.min() * 1e-3, y.min() * 0.05, y[big] / tokens[big],
                 y[big] / (tokens[big] * span[big]) * 0.05, 4.0])
    sharpness = ([-np.inf] * 5 + [0.0], [np.inf] * 5 + [np.log(50.0)])  # between a plain sum and a hard max
    res = least_squares(lambda x: np.log(prefill_time(np.exp(x), rows, tokens, span)) - np.log(y), x0,
                        bounds=sharpness, loss="soft_l1", f_scale=0.05)
    real = [point_shape(p) for p in points]
    return {"method": "smooth-max", **dict(zip(PREFILL_PARAMS, np.exp(res.x).tolist())),
            "rows": [int(rows.min()), int(rows.max())], "tokens": [min(s.tokens for s in real), max(s.tokens for s in real)],
            "span": [min(s.span for s in real), max(s.span for s in real)], "sigma": sigma(points)}


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
            base = np.array([interp(ks, p["kv_max"]) for p in mixed])
            short = np.array([r * p["kv_max"] - p["kv_tokens"] for p in mixed], float)
            y = np.array([p["median_s"] for p in mixed])
            # least squares on relative error of base - b * short = y, b >= 0
            per_token.append(float(lsq_linear((-short / y)[:, None], 1 - base / y, bounds=(0, np.inf)).x[0]))
        else:
            per_token.append(0.0)
    return {"rows": rows, "knots": knots, "per_token_s": per_token, "sigma": sigma(points)}


def fit(prefill_points: list[dict], decode_points: dict[str, list[dict]], engine: dict | None = None) -> dict:
    """The `fit` section for a table's measured points (prefill keyed by shape; decode per backend); `engine` is
    the table's engine section (its prefill rounding)."""
    return {"prefill": fit_prefill(prefill_points, engine),
            "decode": {b: fit_decode(p) for b, p in decode_points.items()}}
