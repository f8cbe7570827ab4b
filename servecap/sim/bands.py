"""Seed bands: one seeded trace is one sample of the workload, so a sweep over several seeds says how far a number
moves with the draw alone (served rates vary 2-5% of the mean from seed to seed near capacity). Anything that
compares two simulated numbers (a sag, two configurations, a prediction against a measurement) should ask
`exceeds_seed_spread` before calling the difference real.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

K_SPREAD = 2.0  # standard errors a difference must exceed to be more than the seed draw


@dataclass(frozen=True)
class Band:
    """One quantity across seeds: mean, sample standard deviation (NaN with one seed), min, max, seeds counted."""

    mean: float
    sd: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Band:
        v = np.asarray([x for x in values if x is not None and math.isfinite(x)], float)
        if v.size == 0:
            return cls(math.nan, math.nan, math.nan, math.nan, 0)
        sd = float(v.std(ddof=1)) if v.size > 1 else math.nan
        return cls(float(v.mean()), sd, float(v.min()), float(v.max()), int(v.size))


def exceeds_seed_spread(a: Sequence[float] | float, b: Sequence[float] | float, *, paired: bool = False,
                        k: float = K_SPREAD) -> bool:
    """Whether mean(a) and mean(b) differ by more than k standard errors of their difference across seeds.

    a and b are one quantity's per-seed values (a single number counts as exact, e.g. a measurement). paired=True
    when a[i] and b[i] ran on the same seed (two configurations of one multi-seed sweep, or two rates of one
    configuration): the seed's own draw then cancels in the difference, which is far more sensitive. With fewer
    than two values in all there is no spread to compare with: False.
    """
    a, b = np.atleast_1d(np.asarray(a, float)), np.atleast_1d(np.asarray(b, float))
    if paired:
        if a.shape != b.shape:
            raise ValueError(f"paired values need one per seed on both sides, got {a.size} and {b.size}")
        d = a - b
        if d.size < 2:
            return False
        return bool(abs(d.mean()) > k * d.std(ddof=1) / math.sqrt(d.size))
    if a.size < 2 and b.size < 2:
        return False
    var = sum(x.var(ddof=1) / x.size for x in (a, b) if x.size > 1)
    return bool(abs(a.mean() - b.mean()) > k * math.sqrt(var))
