"""What fleets add to the simulator's reports: a run's per-replica table and a sweep's fewest replicas that hold
each rate."""
from __future__ import annotations

from dataclasses import replace

import pandas as pd

from servecap.traces.formatting import fmt_ms, fmt_value
from servecap.traces.slo import SLO

from servecap.core.config import SINGLE_ROUTER

from .sweep import ConfigResult


# (heading, column, format) of the per-replica table
_REPLICA_TABLE = (("replica", "replica", "d"), ("requests", "n", "d"), ("share", "share", ".0%"),
                  ("served", "served_rate", ".2f"), ("wait p50 ms", "queue_wait_p50", "ms"),
                  ("p95", "queue_wait_p95", "ms"), ("TTFT p50 ms", "ttft_p50", "ms"), ("p95", "ttft_p95", "ms"),
                  ("TPOT p50 ms", "tpot_p50", "ms"), ("rows", "mean_running_rows", ".1f"),
                  ("blocked", "head_blocked_frac", ".0%"))


def replica_table(per: pd.DataFrame) -> str:
    """servecap.traces.metrics.per_replica's rows as a text table, latencies in ms (with goodput when it was scored against
    SLOs)."""
    cols = _REPLICA_TABLE + ((("goodput", "goodput", ".2f"),) if "goodput" in per else ()) + \
        ((("stable", "stable", None),) if "stable" in per else ())
    cells = [[h for h, _, _ in cols]]
    for row in per.to_dict("records"):
        cells.append([("yes" if row[k] else "NO") if spec is None else fmt_ms(row[k] * 1000.0) if spec == "ms" else
                      fmt_value(row[k], spec) for _, k, spec in cols])
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells)


def fewest_replicas(results: list[ConfigResult], slos: tuple[SLO, ...]) -> list[dict]:
    """For each configuration but its replica count (router included) and each rate every count was tested at:
    the fewest replicas that hold the rate (meet the SLOs when given, else stay stable), None if none does. With
    several workload seeds a count holds a rate when most seeds do, as in the sweep's bands (servecap/sim/report.py). A
    single engine has no router: its results count under every router its fleets were run behind."""
    key = "slo_ok" if slos else "stable"
    # one engine's configuration -> router (None: the single engine's) -> replica count -> its results, one per seed
    engines: dict = {}
    for res in results:
        router = res.config.router if res.config.replicas > 1 else None
        engines.setdefault(replace(res.config, replicas=1), {}).setdefault(router, {}) \
            .setdefault(res.config.replicas, []).append(res)
    found = []
    for engine, by_router in engines.items():
        single = by_router.pop(None, {})
        for router, fleets in (by_router or {SINGLE_ROUTER: {}}).items():
            by_count = {**single, **fleets}
            counts = sorted(by_count)
            rates = sorted(set.intersection(*(set(r.rates) for seeds in by_count.values() for r in seeds)))
            for rate in rates:
                held = [n for n in counts if _holds(by_count[n], rate, key)]
                found.append({"configuration": engine.label, "router": router, "rate": rate,
                              "replicas": min(held) if held else None, "tested": counts})
    return found


def _holds(seeds: list[ConfigResult], rate: float, key: str) -> bool:
    """Whether most seeds' points at `rate` hold (`key`: slo_ok or stable)."""
    return sum(bool(p[key]) for res in seeds for p in res.rows if p["rate"] == rate) * 2 > len(seeds)


def fewest_lines(found: list[dict], slos: tuple[SLO, ...]) -> list[str]:
    by = "meet the SLOs" if slos else "stay stable"
    lines = [f"fewest replicas that {by} at each rate:"]
    if not found:
        return lines + ["  no rate was tested at every replica count (give --rates)"]
    for f in found:
        answer = f"{f['replicas']}" if f["replicas"] is not None else \
            f"none of {','.join(map(str, f['tested']))}"
        lines.append(f"  {f['configuration']}, {f['router']}: rate {f['rate']:g} req/s -> {answer}")
    return lines
