"""Synthetic cost tables: made-up step costs in the real table format, for tests and for benchmarking the
simulator before a measured table exists. Their device name says they are not a measurement.

A table is built from two cost functions sampled on the calibration grid and fitted with the same costs.fit a
measured table uses, so it exercises the whole path a real one takes. Its stationarity section says that its
costs are functions of the shape by construction, which is all a synthetic table can say.
"""
from __future__ import annotations

import math
from typing import Callable

from servecap.traces.model_spec import QWEN25_1P5B, config_hash

from .fit import Z90, fit
from .shapes import PrefillShape, kv_read
from .table import SCHEMA, STATIONARITY_LIMIT, VERSION, as_cost_table, table_id

DEVICE = "synthetic (made-up costs, not a measurement)"
WIDTHS = (1, 2, 4, 8, 16, 32)
LENGTHS = (16, 64, 256, 1024, 2048, 4096)
KV_PER_ROW = (16, 256, 1024, 2048, 4352)  # K/V tokens read per row: the shortest to the longest request
MAX_TOKENS = 4096 + 256  # the longest prompt plus the largest budget
BY_CONSTRUCTION = {"limit": STATIONARITY_LIMIT, "passed": True, "method": "synthetic: costs are functions of the shape",
                   "prefill": {"median": 1.0, "p95": 1.0, "max": 1.0}, "decode": {"median": 1.0, "p95": 1.0, "max": 1.0}}


def _point(keys: dict, median: float, sigma: float) -> dict:
    spread = math.exp(sigma * Z90)
    return {**keys, "median_s": median, "p10_s": median / spread, "p90_s": median * spread, "n": 5}


def synthetic_table(prefill: Callable[[PrefillShape], float], decode: Callable[[str, int, int, int], float], *,
                    retire_s: float = 0.0, sigma: float = 0.0, backends=("paged", "dense"), max_batch: int = 32,
                    block_size: int = 64, model: dict = QWEN25_1P5B, name: str = "synthetic") -> dict:
    """A checked cost table (its JSON object) whose medians are prefill(shape) over padded groups and
    decode(backend, rows, kv_tokens, kv_max): uniform rows at every length of KV_PER_ROW, and rows where
    one long row leads short ones, so the fit can tell the longest row from the total.
    """
    rows = [r for r in WIDTHS if r <= max_batch]
    shapes = [PrefillShape.padded(w, n) for w in rows for n in LENGTHS]
    prefill_points = [_point({"policy": "padded", "rows": s.rows, "tokens": s.tokens, "attn": s.attn}, prefill(s), sigma)
                      for s in shapes]
    decode_points = {}
    for b in backends:
        pts = []
        for r in rows:
            shapes = sorted({(r * k, k) for k in KV_PER_ROW} | {(k + (r - 1) * KV_PER_ROW[0], k) for k in KV_PER_ROW})
            pts += [_point({"rows": r, "kv_tokens": t, "kv_max": m, "kv_read": kv_read(b, r, t, m)},
                           decode(b, r, t, m), sigma) for t, m in shapes]
        decode_points[b] = {"points": pts}
    table = {"schema": SCHEMA, "version": VERSION, "name": name, "device": {"name": DEVICE},
             "model": {"name": model["name"], "config_hash": config_hash(model), "dtype": "float16"},
             "block_size": block_size, "max_batch": max_batch, "max_tokens": MAX_TOKENS,
             "prefill": {"points": prefill_points}, "decode": decode_points, "overhead": {"retire_s": retire_s},
             "stationarity": BY_CONSTRUCTION}
    table["fit"] = fit(prefill_points, {b: d["points"] for b, d in decode_points.items()})
    return _checked(table)


def _checked(table: dict) -> dict:
    table["table_id"] = table_id(table)
    as_cost_table(table)
    return table


def constant_table(prefill_s: float = 0.1, decode_s: float = 0.01, **kw) -> dict:
    """Every prefill costs prefill_s and every decode step decode_s, whatever the shape: hand-computable runs."""
    table = synthetic_table(lambda s: prefill_s, lambda b, r, t, m: decode_s, name="synthetic-constant", **kw)
    # The exact constants the fits only approach (to about 1e-6), so hand calculations hold to the bit.
    table["fit"]["prefill"].update(floor_s=prefill_s, floor_per_row_s=0.0, base_s=0.0, per_token_s=0.0, per_token2_s=0.0)
    for d in table["fit"]["decode"].values():
        n = len(d["rows"])
        d.update(knots=[[[1, decode_s], [MAX_TOKENS, decode_s]]] * n, per_token_s=[0.0] * n)
    return _checked(table)


def linear_table(**kw) -> dict:
    """Costs linear in the work, scaled to the write-up's A10 measurements: a 4096-token prefill of 0.32 s, a
    32 x 4096 padded group of about 10 s, a mixed 32-row decode step of about 45 ms. Both backends cost the
    same per K/V token read; padded reads every row at the widest row's length, so it reads (and costs) more.
    """
    return synthetic_table(lambda s: 0.012 + 7.5e-5 * s.tokens,
                           lambda b, r, t, m: 0.018 + 2e-4 * r + 4e-7 * kv_read(b, r, t, m),
                           name="synthetic-linear", **{"retire_s": 0.002, **kw})
