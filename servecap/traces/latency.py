"""Latency figures under the names and units of `vllm bench serve`: milliseconds, mean/median/std/pNN of TTFT,
TPOT, ITL and E2EL, plus the queue wait that only a simulator or an instrumented engine can see.

Run records keep seconds; this module converts at presentation, so every figure here is in ms (keys end in _ms).
Per request (as servecap/traces/metrics.py defines them): queue wait = admitted - arrival, TTFT = first token - arrival,
TPOT = (finished - first token) / (output tokens - 1) over requests of more than one token, E2EL = finished - arrival
(metrics' sojourn). ITL (inter-token latency) = every gap between consecutive tokens of a request, all requests'
gaps pooled, as vLLM pools them. The gaps need the token records; a record without them still has the exact mean
ITL, because a request's gaps sum to finished - first token: mean ITL = sum(finished - first token) /
sum(output tokens - 1). Its median, std and percentiles are then None, and itl_source says which it was.
std is numpy's population standard deviation and percentiles numpy's linear ones, as vLLM computes them.
"""
from __future__ import annotations

import argparse
import math

from typing import TYPE_CHECKING

import numpy as np

from .formatting import fmt_ms

if TYPE_CHECKING:  # pandas: the CLIs take their defaults from here, and `--help` should not wait for it
    from .records import RunRecord

# p50 for planners (the typical request), p90/p95 for dashboards, p99 vLLM's own default
DEFAULT_PERCENTILES = (50.0, 90.0, 95.0, 99.0)
# metric name -> request_metrics column (itl is pooled from the tokens table)
COLUMNS = {"queue_wait": "queue_wait", "ttft": "ttft", "tpot": "tpot", "e2el": "sojourn"}
METRICS = ("queue_wait", "ttft", "tpot", "itl", "e2el")
LABELS = {"queue_wait": "queue wait", "ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}


def parse_percentiles(text: str) -> tuple[float, ...]:
    """'50,90,99' -> (50.0, 90.0, 99.0): distinct, sorted, each above 0 and at most 100."""
    out = []
    for item in (t.strip() for t in text.split(",")):
        try:
            q = float(item)
        except ValueError:
            q = math.nan
        if not 0 < q <= 100:
            raise ValueError(f"{item!r} is not a percentile above 0 and at most 100 (write e.g. 50,90,99)")
        out.append(q)
    return tuple(sorted(set(out)))


def percentiles_arg(text: str) -> tuple[float, ...]:
    try:
        return parse_percentiles(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


PERCENTILES_HELP = (f"latency percentiles to report, comma-separated (default "
                    f"{','.join(f'{q:g}' for q in DEFAULT_PERCENTILES)}: p50 for the typical request, p99 as vLLM's "
                    f"bench reports by default)")


def p_key(q: float) -> str:
    """vLLM's percentile word: p99, p99.9."""
    return f"p{int(q)}" if float(q).is_integer() else f"p{q:g}"


def latency_keys(percentiles: tuple[float, ...] = DEFAULT_PERCENTILES) -> list[str]:
    """latency_ms()'s keys, in order (a sweep's CSV columns)."""
    return [f"{stat}_{metric}_ms" for metric in METRICS
            for stat in ("mean", "median", "std", *(p_key(q) for q in percentiles))] + ["itl_source"]


def _stats(values_s: np.ndarray, metric: str, percentiles: tuple[float, ...]) -> dict:
    v = np.asarray(values_s, float)
    v = v[np.isfinite(v)] * 1000.0
    nan = v.size == 0
    out = {f"mean_{metric}_ms": math.nan if nan else float(v.mean()),
           f"median_{metric}_ms": math.nan if nan else float(np.median(v)),
           f"std_{metric}_ms": math.nan if nan else float(v.std())}
    for q in percentiles:
        out[f"{p_key(q)}_{metric}_ms"] = math.nan if nan else float(np.percentile(v, q))
    return out


def itl_gaps(rec: RunRecord) -> np.ndarray:
    """Every gap, in seconds, between consecutive token times of a request (the tokens table), all requests pooled."""
    t = rec.tokens
    if t.empty:
        return np.empty(0)
    t = t.sort_values(["request_id", "index"], kind="stable")
    rid, time = t["request_id"].to_numpy(), t["time"].to_numpy(float)
    return np.diff(time)[rid[1:] == rid[:-1]]


def latency_ms(rec: RunRecord, percentiles: tuple[float, ...] = DEFAULT_PERCENTILES) -> dict:
    """mean_/median_/std_/pNN_ of queue_wait, ttft, tpot, itl and e2el in ms, and itl_source ('tokens' or
    'requests': the mean alone, see the module docstring)."""
    from .metrics import request_metrics
    m = request_metrics(rec)
    out: dict = {}
    for metric in METRICS:
        if metric != "itl":
            out.update(_stats(m[COLUMNS[metric]].to_numpy(), metric, percentiles))
            continue
        if not rec.tokens.empty:
            out.update(_stats(itl_gaps(rec), "itl", percentiles))
            out["itl_source"] = "tokens"
            continue
        out.update({k: None for k in _stats(np.empty(0), "itl", percentiles)})
        served = rec.requests[rec.requests["finished"].notna()]
        decoded = float((served["output_tokens"] - 1).clip(lower=0).sum())
        out["mean_itl_ms"] = float((served["finished"] - served["first_token"]).sum()) / decoded * 1000.0 \
            if decoded > 0 else math.nan
        out["itl_source"] = "requests"
    return out


def throughput(rec: RunRecord) -> dict:
    """vLLM's counts and rates over the run's span (first arrival to last finish, as servecap/traces/metrics' served rate):
    completed, duration (s), total_input_tokens, total_output_tokens, request_throughput (req/s),
    output_throughput and total_token_throughput (tok/s)."""
    served = rec.requests[rec.requests["finished"].notna()]
    duration = float(served["finished"].max() - served["arrival"].min()) if len(served) else math.nan
    inp, outp = int(served["prompt_tokens"].sum()), int(served["output_tokens"].sum())

    def per_s(x: float) -> float:
        return x / duration if duration > 0 else math.nan
    return {"completed": len(served), "duration": duration, "total_input_tokens": inp, "total_output_tokens": outp,
            "request_throughput": per_s(len(served)), "output_throughput": per_s(outp),
            "total_token_throughput": per_s(inp + outp)}


def latency_table(lat: dict, percentiles: tuple[float, ...], indent: str = "  ") -> str:
    """latency_ms' figures as a text table in ms: one row per metric, mean, median, std and the percentiles."""
    heads = ["ms", "mean", "median", "std", *(p_key(q) for q in percentiles)]
    cells = [heads]
    for metric in METRICS:
        keys = [f"mean_{metric}_ms", f"median_{metric}_ms", f"std_{metric}_ms",
                *(f"{p_key(q)}_{metric}_ms" for q in percentiles)]
        cells.append([LABELS[metric], *(fmt_ms(lat.get(k)) for k in keys)])
    widths = [max(len(c[i]) for c in cells) for i in range(len(heads))]
    lines = [indent + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in cells]
    if lat.get("itl_source") == "requests":
        lines.append(f"{indent}ITL: the mean alone (the record keeps no token times to take its spread from)")
    return "\n".join(lines)
