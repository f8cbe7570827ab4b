"""Service-level objectives: per-request latency limits, named as vLLM's benchmark names its --goodput ones.

    ttft_p99=2,tpot_p99=0.05,e2el_p99=20      (NAME=SECONDS: servecap's form, like every time in its records)
    ttft:500,tpot:50                           (NAME:MILLISECONDS: vLLM's --goodput form)

NAME is ttft (arrival to first token), tpot (time per output token after the first) or e2el (end-to-end latency:
arrival to last token; e2e is accepted for it). The value is a limit in seconds that every request is held to:
a request that meets every limit counts toward goodput. A _pNN suffix (0 < NN <= 100) also asks that the NNth
percentile of the metric be within the limit before a point counts toward SLO capacity (servecap/traces/metrics.py).
`=` takes seconds and `:` milliseconds, so a vLLM user's `--goodput ttft:500` means here what it means there; a
value that names its unit (`ttft_p95=500ms`, `ttft:0.5s`) is taken in that unit under either sign. Every report
states the unit (describe(), in ms).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .errors import InputError
from .formatting import fmt_value

# SLO name -> the traces.metrics.request_metrics column it limits
COLUMNS = {"ttft": "ttft", "tpot": "tpot", "e2el": "sojourn"}
ALIASES = {"e2e": "e2el"}
_NAME = re.compile(r"(?P<metric>[a-z0-9]+?)(?:_p(?P<q>\d+(?:\.\d+)?))?")
_VALUE = re.compile(r"(?P<number>.*?)\s*(?P<unit>ms|s)?")
_FORM = ("write NAME[_pNN]=SECONDS or NAME[_pNN]:MILLISECONDS with NAME one of ttft, tpot, e2el (or e2e), e.g. "
         "ttft_p99=2,tpot_p99=0.05 or ttft:500,tpot:50 (or with the unit named: ttft_p99=500ms)")


@dataclass(frozen=True)
class SLO:
    metric: str  # ttft, tpot or e2el
    limit_s: float
    percentile: float | None = None  # the tail that must also be within the limit, when given

    @property
    def name(self) -> str:
        return self.metric if self.percentile is None else f"{self.metric}_p{self.percentile:g}"

    @property
    def column(self) -> str:
        return COLUMNS[self.metric]

    def __str__(self) -> str:
        return f"{self.name}={self.limit_s:g}"


def parse_slo(item: str) -> SLO:
    """One NAME[_pNN]=SECONDS or NAME[_pNN]:MILLISECONDS, the value optionally with its unit (ms or s)."""
    text = item.strip()
    sep = "=" if "=" in text else ":"
    name, eq, value = text.partition(sep)
    m = _NAME.fullmatch(name.strip().lower())
    if not eq or m is None or ("=" in value or ":" in value):
        raise InputError(f"{item!r} is not an SLO: {_FORM}")
    metric = ALIASES.get(m["metric"], m["metric"])
    if metric not in COLUMNS:
        raise InputError(f"{item!r}: unknown SLO metric {m['metric']!r}; {_FORM}")
    q = float(m["q"]) if m["q"] is not None else None
    if q is not None and not 0 < q <= 100:
        raise InputError(f"{item!r}: the percentile must be above 0 and at most 100")
    v = _VALUE.fullmatch(value.strip().lower())
    unit = v["unit"] or ("s" if sep == "=" else "ms")
    try:
        limit = float(v["number"])
    except ValueError:
        limit = math.nan
    if not (math.isfinite(limit) and limit > 0):
        raise InputError(f"{item!r}: the limit must be a positive number of "
                         f"{'seconds' if unit == 's' else 'milliseconds'}")
    return SLO(metric, limit if unit == "s" else limit / 1000.0, q)


def parse_slos(text: str) -> tuple[SLO, ...]:
    """Comma-separated SLOs, at most one per metric (a request is held to one limit of each)."""
    slos = tuple(parse_slo(item) for item in text.split(",") if item.strip())
    if not slos:
        raise InputError(f"no SLO given: {_FORM}")
    metrics = [s.metric for s in slos]
    twice = sorted({m for m in metrics if metrics.count(m) > 1})
    if twice:
        raise InputError(f"{text!r}: more than one SLO for {', '.join(twice)}; give each metric one limit")
    return slos


def limit_ms(slo: SLO) -> str:
    """'500 ms': the limit as reports print it (vLLM's unit)."""
    return f"{slo.limit_s * 1000.0:.6g} ms"


def describe(slos: tuple[SLO, ...]) -> str:
    """'ttft <= 2000 ms (and its p99), tpot <= 50 ms' for reports."""
    return ", ".join(f"{s.metric} <= {limit_ms(s)}" + (f" (and its p{s.percentile:g})" if s.percentile else "")
                     for s in slos)


def slo_line(s: dict, slos: tuple[SLO, ...]) -> str:
    """A run's goodput, attainment and tails against its SLOs (metrics.summary's keys), and the verdict when it has a
    rate: the line `sim run` and `engine run` print."""
    attained = ", ".join(f"{slo.metric} {fmt_value(s[f'attain_{slo.metric}'], '.1%')}" for slo in slos)
    tails = [f"{slo.name} {fmt_value(s[slo.name] * 1000.0, '.4g')} ms (limit {limit_ms(slo)})"
             for slo in slos if slo.percentile]
    verdict = "" if "slo_ok" not in s else "; SLOs met" if s["slo_ok"] else "; SLOs NOT met"
    return (f"SLOs     {describe(slos)}: goodput {fmt_value(s['goodput'], '.2f')} req/s "
            f"({fmt_value(s['good_fraction'], '.1%')} of requests met every SLO); within limits: {attained}"
            + (f"; {', '.join(tails)}" if tails else "") + verdict)
