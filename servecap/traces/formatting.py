"""How reports print a figure: one rule for every command's text, so that the engine's and the simulator's read
alike."""
from __future__ import annotations

import math


def fmt_value(v, spec: str = ".2f") -> str:
    """A figure as reports print it: '-' where there is none (None or NaN)."""
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def fmt_ms(v) -> str:
    """A time in ms as reports print it: three significant figures below 10 ms, one decimal below 1 s."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:#.3g}" if abs(v) < 10 else f"{v:.1f}" if abs(v) < 1000 else f"{v:,.0f}"
