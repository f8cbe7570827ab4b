"""`--save-result FILE.json`: one run's figures as a flat JSON object under the keys `vllm bench serve
--save-result` writes (request_throughput, output_throughput, total_token_throughput, mean/median/std/pNN _ttft_ms,
_tpot_ms, _itl_ms, _e2el_ms, completed, duration, ...), so a vLLM user's scripts read it as they read vLLM's, with
servecap's provenance beside them (backend "servecap-sim" or "servecap-engine", cost table id, seed, trace id, git
commit, the configuration).

Two differences from vLLM, both in the file: duration is the run's span (first arrival to last finish, the served
rate's denominator in servecap/traces/metrics.py), not the benchmark client's wall time; and the queue wait figures
(..._queue_wait_ms) are servecap's own. With SLOs, request_goodput is vLLM's goodput (requests meeting every SLO
per second) and the SLOs are written with their limits in ms.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from .csvio import atomic_write_text
from .errors import InputError
from .latency import DEFAULT_PERCENTILES, latency_ms, throughput
from .outpath import check_out_file
from .records import RunRecord
from .slo import SLO

SCHEMA = "servecap-bench-result"
VERSION = 1


def check_result_path(path: str | Path) -> Path:
    """Refused before the run: a directory, an unwritable place, or a file already there (a result is not
    overwritten)."""
    path = check_out_file(path)
    if path.exists() or path.is_symlink():
        raise InputError("already exists; a saved result is not overwritten: choose another file", path=path)
    return path


def bench_result(rec: RunRecord, summary: dict, *, backend: str, percentiles: tuple[float, ...] = DEFAULT_PERCENTILES,
                 slos: tuple[SLO, ...] = (), provenance: dict | None = None) -> dict:
    """The flat result: vLLM's keys, then servecap's (see the module docstring). `summary` is traces.metrics.summary's
    dict of the same run, scored against `slos`."""
    doc = {"backend": backend, **throughput(rec), **latency_ms(rec, percentiles),
           "percentile_metrics": "queue_wait,ttft,tpot,itl,e2el",
           "metric_percentiles": ",".join(f"{q:g}" for q in percentiles)}
    if slos:
        doc["request_goodput"] = summary.get("goodput")
        doc["goodput_slos_ms"] = {s.name: s.limit_s * 1000.0 for s in slos}
        doc["slo_ok"] = summary.get("slo_ok")
    for k in ("rate", "expected_rate", "stable"):
        if k in summary:
            doc[{"rate": "request_rate"}.get(k, k)] = summary[k]
    doc.update({"schema": SCHEMA, "version": VERSION, **(provenance or {})})
    return doc


def json_safe(value):
    """`value` with every non-finite float as None (JSON has no NaN), through dicts, lists and tuples."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_result(path: str | Path, doc: dict) -> Path:
    path = Path(path)
    atomic_write_text(path, json.dumps(json_safe(doc), indent=1) + "\n")
    return path
