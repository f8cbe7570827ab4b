"""Request-trace files: CSV with a JSON header line, validated on read."""
from __future__ import annotations

import math
from pathlib import Path

from .csvio import read_table, write_table
from .errors import InputError
from .workload import ARRIVAL_DECIMALS, Request, Trace

SCHEMA = "request-trace"
VERSION = 1
COLUMNS = ("request_id", "arrival_s", "prompt_tokens", "budget", "prompt")


def write_trace(trace: Trace, path: str | Path) -> Path:
    """Write a trace; the same trace always gives the same bytes."""
    path = Path(path)
    rows = ([r.request_id, f"{r.arrival:.{ARRIVAL_DECIMALS}f}", r.prompt_tokens, r.budget, r.prompt]
            for r in trace.requests)
    write_table(path, SCHEMA, VERSION, COLUMNS, rows, {"trace_id": trace.trace_id, "meta": trace.meta})
    return path


def _int(value: str, path: Path, line: int, column: str, minimum: int) -> int:
    try:
        f = float(value)
    except ValueError:
        raise InputError(f"{value!r} is not a number", path=path, row=line, column=column) from None
    if math.isnan(f) or not f.is_integer():
        raise InputError(f"{value!r} is not a whole number", path=path, row=line, column=column)
    if f < minimum:
        raise InputError(f"{value!r} must be at least {minimum}", path=path, row=line, column=column)
    return int(f)


def read_trace(path: str | Path) -> Trace:
    """Read and validate a trace file; any bad row is refused with its line and column."""
    path = Path(path)
    header, rows = read_table(path, SCHEMA, (VERSION,), COLUMNS)
    reqs, last = [], 0.0
    for line, (rid, arrival, ptoks, budget, prompt) in enumerate(rows, start=3):
        try:
            a = float(arrival)
        except ValueError:
            raise InputError(f"{arrival!r} is not a number", path=path, row=line, column="arrival_s") from None
        if not math.isfinite(a) or a < 0:
            raise InputError(f"arrival {arrival!r} must be a finite time >= 0", path=path, row=line, column="arrival_s")
        if a < last:
            raise InputError(f"arrival {a} is earlier than the previous row's {last}: traces must be sorted by arrival",
                             path=path, row=line, column="arrival_s")
        last = a
        reqs.append(Request(_int(rid, path, line, "request_id", 0), a,
                            _int(ptoks, path, line, "prompt_tokens", 1), _int(budget, path, line, "budget", 1), prompt))
    # The trace id is recomputed from the rows, so a hand-edited file gets the id of what it now holds.
    return Trace(reqs, header.get("meta", {}))
