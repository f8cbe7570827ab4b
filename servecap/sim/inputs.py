"""What a simulation runs on, checked before anything runs or is written: the cost table, the trace, the pool.

Every problem is an InputError that names what to fix.
"""
from __future__ import annotations

from operator import attrgetter
from pathlib import Path

from servecap.costs.table import CostTable, check_compatible, load_cost_table
from servecap.core.block_pool import largest_request_tokens
from servecap.core.config import ServingConfig
from servecap.traces.errors import InputError
from servecap.traces.importers import import_note
from servecap.traces.memory import check_fits
from servecap.traces.model_spec import QWEN25_1P5B, config_hash
from servecap.traces.trace_io import read_trace, requested_trace
from servecap.traces.workload import BEYOND_POSITIONS_HINT, Trace, beyond_positions

SHIPPED_TABLE = Path(__file__).resolve().parents[1] / "costs" / "data" / "h200.json"
MODEL = QWEN25_1P5B
# Peak bytes one simulated request of the mixed draw takes, trace included, by what is kept of the run: `sim run`'s
# peak resident memory over 20,000-200,000 requests measured 0.7 KB scored only, 2.2 KB with the step rows (--out)
# and 12 KB with every token's (--tokens); about twice that, since a peak is no place to be near.
BYTES_PER_REQUEST = {"summary": 1_500, "steps": 4_000, "tokens": 25_000}


def load_table(path: str | Path | None, serving: ServingConfig = ServingConfig(),
               allow_nonstationary: bool = False) -> CostTable:
    """The cost table at `path` (default: the shipped H200 table), refused if it is for another model or block size
    than `serving`'s."""
    if path is None:
        if not SHIPPED_TABLE.exists():
            raise InputError(f"the shipped H200 cost table ({SHIPPED_TABLE}) is not there yet: it is written by the "
                             f"GPU calibration (calibrate/). Pass --table FILE to simulate with a cost table you have")
        path = SHIPPED_TABLE
    table = load_cost_table(path, allow_nonstationary=allow_nonstationary)
    check_compatible(table, config_hash(serving.spec), serving.block_size)
    return table


def check_memory(requests: int, detail: str = "summary", processes: int = 1) -> None:
    """Refuse a run of `requests` requests per process, keeping `detail`, that this machine cannot hold: it would end
    in a MemoryError after minutes of simulating."""
    kept = {"summary": "", "steps": " with its step rows", "tokens": " with every token's time"}[detail]
    on = f" in each of {processes} processes" if processes > 1 else ""
    check_fits(BYTES_PER_REQUEST[detail] * requests * processes, f"simulating {requests:,} requests{kept}{on}",
               "ask for fewer requests (--n)" + (" or fewer processes (--jobs)" if processes > 1 else ""))


def check_backend(table: CostTable, backend: str) -> None:
    if backend not in table.backends:
        raise InputError(f"{table.summary()} has no decode costs for backend {backend!r} "
                         f"(it has {', '.join(table.backends)})")


def load_trace(path: str | Path) -> Trace:
    """A trace file, refused if its metadata names a model other than the one the simulator models."""
    trace = read_trace(path)
    named = trace.meta.get("model")
    if isinstance(named, dict):
        mismatch = named.get("config_hash", config_hash(MODEL)) != config_hash(MODEL) or \
            named.get("name", MODEL["name"]) != MODEL["name"]
    else:
        mismatch = named is not None and named != MODEL["name"]
    if mismatch:
        raise InputError(f"the trace was made for model {named}, not {MODEL['name']}", path=path)
    if not trace.requests:
        raise InputError("the trace has no requests", path=path)
    return trace


def import_meta(trace: Trace) -> dict:
    """{"import": what the trace's import dropped or clipped} for a run's saved metadata, or {} for a trace that was
    not imported."""
    note = import_note(trace.meta)
    return {"import": note} if note else {}


def described(path: str | Path, trace: Trace) -> str:
    """A trace file as a report names it: its path, its size and what its import dropped or clipped."""
    note = import_note(trace.meta)
    return f"trace {path} ({len(trace)} requests{f'; import: {note}' if note else ''})"


def closed(trace: Trace) -> Trace:
    """The same requests all arriving at t=0: the engine saturated from the first step."""
    reqs = [r.at(0.0) for r in trace.requests]
    return Trace(reqs, {"kind": "closed", "from": trace.trace_id})


def make_trace(**request) -> Trace:
    """The trace a command asks for (servecap/traces/trace_io.py requested_trace), a trace file read as the simulator
    reads one (load_trace: refused if made for another model)."""
    return requested_trace(read=load_trace, **request)


def pool_blocks(trace: Trace, serving: ServingConfig) -> int:
    """The blocks of `serving`'s pool for this trace (an unbounded pool holds max_batch of its largest request)."""
    return serving.pool_blocks(largest_request_tokens(trace.requests))


def check_trace(trace: Trace, table: CostTable, serving: ServingConfig, pool_blocks: int) -> None:
    """Refuse a trace the engine would refuse any request of (too large for the pool or the model, empty,
    a repeated id), naming the first such request; the engine's own scheduler does the checking."""
    trace.check_arrivals()  # a --rate far below a trace's own can scale its times past what float64 resolves
    largest = max(trace.requests, key=lambda r: r.prompt_tokens + r.budget)
    positions = serving.max_positions
    if largest.prompt_tokens + largest.budget > positions:
        # A full-length public trace holds many such requests: say how many, and how to keep the rest.
        over = beyond_positions(trace.requests, positions)
        first = over[0]
        raise InputError(f"{len(over):,} of {len(trace):,} requests are beyond the model's {positions} positions "
                         f"(prompt + budget; the first, request {first.request_id}: {first.prompt_tokens} + "
                         f"{first.budget}); {BEYOND_POSITIONS_HINT}")
    block_size = serving.block_size
    need = serving.blocks_for(largest.prompt_tokens + largest.budget)
    if need > pool_blocks:
        raise InputError(f"the pool is smaller than the largest request: request {largest.request_id} needs {need} "
                         f"blocks of {block_size} tokens ({largest.prompt_tokens} prompt + {largest.budget} budget) "
                         f"and the pool has {pool_blocks}")
    # Every request now fits the pool. The scheduler's other rules, checked in bulk: only a trace that breaks one
    # goes through the scheduler request by request (some 3 us a request), to be refused in its words.
    reqs = trace.requests
    if (min(map(attrgetter("prompt_tokens"), reqs)) > 0 and min(map(attrgetter("budget"), reqs)) > 0
            and largest.prompt_tokens + largest.budget <= serving.max_positions
            and len(set(map(attrgetter("request_id"), reqs))) == len(reqs)
            and not (serving.max_num_batched_tokens and serving.prefill.group_tokens(1, 1, 1))):
        return
    sched = serving.scheduler(pool_blocks, serving.max_positions)
    for req in reqs:
        sched.submit(req)
