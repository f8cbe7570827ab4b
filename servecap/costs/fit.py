"""Fitting a cost table's model (servecap/costs/model.py) to its measured points, with scipy's robust least squares.

Calibration fits the tables it writes; synthetic tables are fitted the same way, so they exercise the same path.
The simulator only evaluates a fit, and never imports this module.
"""
from __future__ import annotations

import math

import numpy as np
from scipy.optimize import least_squares, lsq_linear

from servecap.traces.errors import InputError

from .model import PrefillRounding, interp, kv_read_per_token, longest_context, prefill_time
from .shapes import PrefillShape
from .table import (MIXED_FIXED_PARAM, MIXED_PER_TOKEN_PARAM, PATH_PARAM, PREFILL_PARAMS, PREFIX_PARAM,
                    decode_rows_apart)

Z90 = 1.2815515655446004  # the 90th percentile of a standard normal


def sigma(points: list[dict]) -> float:
    """Median log-normal sigma implied by the points' p10/p90."""
    return float(np.median([math.log(p["p90_s"] / p["p10_s"]) / (2 * Z90) for p in points]))


def point_shape(p: dict) -> PrefillShape:
    """A prefill point's step: its sequences when it lists them, else a padded group (rows x tokens / rows)."""
    if "computed" in p:
        return PrefillShape.of(p["computed"], p.get("prefix"), p.get("decode", 0))
    return PrefillShape.padded(p["rows"], p["tokens"] // p["rows"])


def fit_prefill(points: list[dict], engine: dict | None = None, kv_per_token: float | None = None) -> dict:
    """The smooth-max surface over prefill points (servecap/costs/model.py), with the engine's rounding when known.
    Where the engine attends a fused step's decode rows with its decode kernel (engine.mixed_decode_attention), the
    fused points' decode rows get two terms of their own: per K/V token (`kv_per_token`, the decode fit's; fitted
    only where there is none) and fixed, and only their prompt positions' attention is the surface's."""
    rounding = PrefillRounding(engine)
    shapes = [point_shape(p) for p in points]
    split = decode_rows_apart(engine)
    attended = [s.prompts if split else s for s in shapes]
    # Attention over the pool's K/V gets a coefficient of its own where points have any (chunks after a prefix), and
    # the longest program's keys one more where the points include fused steps (servecap/costs/model.py).
    apart = any(any(s.prefix) for s in shapes)
    path = apart and any(p.get("policy") == "mixed" for p in points)
    mixed = split and any(s.decode for s in shapes)
    feats = [rounding.split(s, a) if apart else (*rounding.features(s, a), 0.0) for s, a in zip(shapes, attended)]
    rows = np.array([p["rows"] for p in points], float)
    tokens = np.array([f[0] for f in feats], float)
    span = np.array([f[1] for f in feats], float)
    prefix = np.array([f[2] for f in feats], float) * tokens
    longest = np.array([longest_context(a) for a in attended], float)
    decode_kv = np.array([s.decode_kv if split else 0 for s in shapes], float)
    fused = decode_kv > 0
    y = np.array([p["median_s"] for p in points], float)
    big = np.argmax(tokens)
    # Start from the floor at the smallest shape and the throughput of the largest; positive through exp().
    x0 = [y.min(), y.min() * 1e-3, y.min() * 0.05, y[big] / tokens[big], y[big] / (tokens[big] * span[big]) * 0.05,
          4.0] + ([y[big] / (tokens[big] * span[big]) * 0.05] if apart else [])
    if path:  # a key on the critical path: of the order of a decode step's per token
        x0.append(y.min() * 1e-4)
    at = len(x0)
    # The decode rows' K/V reads are the decode kernel's, which the decode points measure (kv_per_token); in closed
    # fused runs they grow with the chunks' prefixes, so the fused points alone cannot tell the two apart. Only the
    # kernel's launches are fitted here, unless no decode fit prices the reads.
    fixed_kv = mixed and kv_per_token is not None
    if mixed:
        x0 += [y.min() * 0.01] + ([] if fixed_kv else [y.min() * 1e-6])
    n = len(x0)
    bounds = ([-np.inf] * n, [np.inf] * n)
    bounds[0][5], bounds[1][5] = 0.0, np.log(50.0)  # the sharpness: between a plain sum and a hard max

    def mixed_terms(e) -> tuple[float, float]:
        return (kv_per_token if fixed_kv else e[at + 1]), e[at]

    def model(x):
        e = np.exp(x)
        extra = e[6] * prefix if apart else 0.0
        t = prefill_time(e[:6], rows, tokens, span, extra + (e[7] * longest if path else 0.0))
        if not mixed:
            return t
        per_token, launches = mixed_terms(e)
        return t + np.where(fused, per_token * decode_kv + launches, 0.0)

    res = least_squares(lambda x: np.log(model(x)) - np.log(y), np.log(x0), bounds=bounds, loss="soft_l1",
                        f_scale=0.05)
    e = np.exp(res.x).tolist()
    real = shapes
    return {"method": "smooth-max", **dict(zip(PREFILL_PARAMS, e[:6])), **({PREFIX_PARAM: e[6]} if apart else {}),
            **({PATH_PARAM: e[7]} if path else {}),
            **(dict(zip((MIXED_PER_TOKEN_PARAM, MIXED_FIXED_PARAM), mixed_terms(e))) if mixed else {}),
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
        # A row one token shorter saves at most what one token more of each row costs a uniform batch, over its
        # rows: the steepest knot segment / r. Without the bound, noisy steps (a shared CPU) can fit a saving that
        # prices a batch of short rows below zero.
        most = max([0.0, *((b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(ks, ks[1:]))]) / r
        if mixed and most > 0:
            base = np.array([interp(ks, p["kv_max"]) for p in mixed])
            short = np.array([r * p["kv_max"] - p["kv_tokens"] for p in mixed], float)
            y = np.array([p["median_s"] for p in mixed])
            # least squares on relative error of base - b * short = y, 0 <= b <= most
            per_token.append(float(lsq_linear((-short / y)[:, None], 1 - base / y, bounds=(0, most)).x[0]))
        else:
            per_token.append(0.0)
    # "floor": priced never below the uniform batch at the mean length (CostModel.decode_stretch_in_context); a
    # table fitted before has no such key and is priced as it always was.
    return {"rows": rows, "knots": knots, "per_token_s": per_token, "floor": "uniform-mean", "sigma": sigma(points)}


def fit(prefill_points: list[dict], decode_points: dict[str, list[dict]], engine: dict | None = None) -> dict:
    """The `fit` section for a table's measured points (prefill keyed by shape; decode per backend); `engine` is
    the table's engine section (its prefill rounding)."""
    decode = {b: fit_decode(p) for b, p in decode_points.items()}
    per_token = kv_read_per_token(decode["paged"]) if "paged" in decode else None
    return {"prefill": fit_prefill(prefill_points, engine, per_token), "decode": decode}
