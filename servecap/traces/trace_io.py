"""Request-trace files: CSV with a JSON header line, validated on read."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

from .csvio import parse_hash_id, parse_int, read_table, write_table
from .errors import InputError
from .importers import AZURE_COLUMNS, MOONCAKE_COLUMNS, MOONCAKE_HASHES
from .prompts import PROMPT_LENGTHS
from .workload import (ARRIVAL_DECIMALS, DEFAULT_BUDGET, DEFAULT_N, Request, Trace, arrival_limit_error, at_rate,
                       check_rate, closed_mixed, closed_uniform, hash_error, poisson_trace)

SCHEMA = "request-trace"
VERSION = 1  # requests without hash ids
HASHED_VERSION = 2  # adds each request's prompt block hashes; a reader of version 1 alone refuses it, not drops them
COLUMNS = ("request_id", "arrival_s", "prompt_tokens", "budget", "prompt")
HASH_COLUMNS = ("hash_block", "hash_ids")  # tokens per block (0: none), the ids separated by spaces
VERSION_COLUMNS = {VERSION: COLUMNS, HASHED_VERSION: COLUMNS + HASH_COLUMNS}


def write_trace(trace: Trace, path: str | Path) -> Path:
    """Write a trace; the same trace always gives the same bytes. A trace without hash ids is a version 1 file,
    byte for byte what it was before hash ids existed; with any, every row carries its hash columns (version 2)."""
    path = Path(path)
    hashed = any(r.hash_block or r.hash_ids for r in trace.requests)

    def row(r: Request) -> list:
        plain = [r.request_id, f"{r.arrival:.{ARRIVAL_DECIMALS}f}", r.prompt_tokens, r.budget, r.prompt]
        return plain + [r.hash_block, " ".join(map(str, r.hash_ids))] if hashed else plain

    version = HASHED_VERSION if hashed else VERSION
    write_table(path, SCHEMA, version, VERSION_COLUMNS[version], map(row, trace.requests),
                {"trace_id": trace.trace_id, "meta": trace.meta})
    return path


def _hash_ids(text: str, path: Path, line: int) -> tuple[int, ...]:
    return tuple(parse_hash_id(t, path, line, "hash_ids") for t in text.split(" ")) if text else ()


def _refuse_unimported(path: Path) -> None:
    """A source file given where a trace is expected (the Azure CSV, a Mooncake JSONL, or any table without the
    trace's header line) is refused naming the importer that makes a trace of it, not only the header line it
    lacks."""
    try:
        with open(path, "rb") as f:
            first = f.readline(64 * 1024).decode("utf-8", "replace")
    except OSError:
        return  # read_table says why the file cannot be read
    if first.startswith("# "):
        return
    try:
        keys = set(json.loads(first)) if first.lstrip().startswith("{") else set()
    except (ValueError, TypeError):
        keys = set()
    if {*MOONCAKE_COLUMNS, MOONCAKE_HASHES} <= keys:
        raise InputError(f"is a raw Mooncake trace (JSON lines of {', '.join((*MOONCAKE_COLUMNS, MOONCAKE_HASHES))}), "
                         f"not a request trace: import it first with `python -m traces import-mooncake {path} "
                         f"--out TRACE.csv`", path=path, row=1)
    names = {c.strip().strip('"') for c in first.split(",")}
    if set(AZURE_COLUMNS) <= names:
        raise InputError(f"is a raw Azure LLM inference trace (columns {', '.join(AZURE_COLUMNS)}), not a request "
                         f"trace: import it first with `python -m traces import-azure {path} --out TRACE.csv`",
                         path=path, row=1)
    if len(names) > 1:
        raise InputError("is a table without the request trace's header line, not a trace: import it first with "
                         "`python -m traces import FILE --timestamp COL --input COL --output COL --out TRACE.csv` "
                         "(or import-lengths for lengths alone)", path=path, row=1)


def read_trace(path: str | Path) -> Trace:
    """Read and validate a trace file; any bad row is refused with its line and column."""
    path = Path(path)
    _refuse_unimported(path)
    header, rows = read_table(path, SCHEMA, tuple(VERSION_COLUMNS), VERSION_COLUMNS)
    reqs, last = [], 0.0
    first_line: dict[int, int] = {}  # request id -> the line that gave it
    for line, (rid, arrival, ptoks, budget, prompt, *hashes) in enumerate(rows, start=3):
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
        hash_block, hash_ids = (parse_int(hashes[0], path, line, "hash_block", 0),
                                _hash_ids(hashes[1], path, line)) if hashes else (0, ())
        req = Request(parse_int(rid, path, line, "request_id", 0), a, parse_int(ptoks, path, line, "prompt_tokens", 1),
                      parse_int(budget, path, line, "budget", 1), prompt, hash_ids, hash_block)
        bad_hashes = hash_error(req.prompt_tokens, req.hash_ids, req.hash_block)
        if bad_hashes:
            raise InputError(bad_hashes, path=path, row=line, column="hash_ids")
        too_late = arrival_limit_error(a, req.request_id)
        if too_late:
            raise InputError(too_late, path=path, row=line, column="arrival_s")
        # Refused here, where the file and line are known: the engine would serve one of the two and the
        # simulator refuse the trace, neither saying where the repeat is.
        if req.request_id in first_line:
            raise InputError(f"request id {req.request_id} is repeated (first on line {first_line[req.request_id]})",
                             path=path, row=line, column="request_id")
        first_line[req.request_id] = line
        # The engine prefills a named prompt's own tokens, so its name and length must agree.
        if prompt and PROMPT_LENGTHS.get(prompt) != req.prompt_tokens:
            raise InputError(f"prompt {prompt!r} does not have {req.prompt_tokens} tokens (the named prompts are "
                             f"{PROMPT_LENGTHS})", path=path, row=line, column="prompt")
        reqs.append(req)
    meta = header.get("meta", {})
    if not isinstance(meta, dict):
        raise InputError("the header's 'meta' is not a JSON object", path=path, row=1)
    # The trace id is recomputed from the rows, so a hand-edited file gets the id of what it now holds.
    return Trace(reqs, meta)


def requested_trace(*, rate: float | None = None, n: int | None = None, seed: int | None = None,
                    trace_file: str | Path | None = None,
                    closed_mixed_n: int | None = None, closed_uniform_prompt: str | None = None,
                    budget: int = DEFAULT_BUDGET, burstiness: float = 1.0, ramp_up_s: float = 0.0,
                    read: Callable[[str | Path], Trace] = read_trace) -> Trace:
    """The trace a command asks for, as `sim run` and `engine run` take it: a trace file read by `read` (at `rate`
    if given), a closed run (`budget` tokens a --closed-uniform request), or a seeded Poisson trace (gamma arrivals
    with burstiness != 1, ramped up over ramp_up_s); `n` and `seed` None: their defaults (DEFAULT_N, 0)."""
    n, seed = DEFAULT_N if n is None else n, 0 if seed is None else seed
    closed = closed_mixed_n is not None or closed_uniform_prompt is not None
    if (burstiness != 1.0 or ramp_up_s > 0) and (rate is None or trace_file is not None or closed):
        raise InputError("--burstiness and --ramp-up-s shape the seeded trace of --rate alone; a trace file or a "
                         "closed run keeps its own arrivals")
    if trace_file is not None:
        trace = read(trace_file)
        return at_rate(trace, rate) if rate is not None else trace
    if closed:
        if rate is not None:
            raise InputError("a closed run has every request arrive at t=0; it takes no --rate")
        return closed_mixed(closed_mixed_n, seed) if closed_mixed_n is not None else \
            closed_uniform(closed_uniform_prompt, n, budget)
    if rate is None:
        raise InputError("give a workload: --rate, --trace FILE, --closed-mixed N or --closed-uniform PROMPT")
    return poisson_trace(check_rate(rate), n, seed, burstiness, ramp_up_s)
