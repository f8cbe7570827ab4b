"""Public request traces (arrival times and token lengths in a CSV or JSONL file) as workload traces.

Every row is kept at its real lengths unless an explicit option removes or cuts it (the time window, a prompt
cap, an output cap), and what they did is counted in the report; a malformed row is refused with its file, line
and column, never skipped. The report, the options and the source file's hash go into the trace's metadata, so a
trace file says where it came from and what its import left out (import_note). A file of lengths alone (no
arrival times) is resampled and given seeded Poisson arrivals (import_lengths). Mooncake's traces keep their
prompts' block hashes (import_mooncake).
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import re
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timedelta, timezone
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Iterator

from .csvio import decode_text, parse_hash_id, parse_int, read_bytes
from .errors import InputError
from .workload import Trace, hash_error, length_trace, poisson_arrivals, row_draw

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
# Mooncake's FAST'25 traces: JSON lines of a millisecond timestamp, the lengths, and one hash id per 512-token block.
MOONCAKE_COLUMNS = ("timestamp", "input_length", "output_length")
MOONCAKE_HASHES, MOONCAKE_BLOCK = "hash_ids", 512
FORMATS = ("csv", "jsonl")
# The units numeric timestamps may be in, coarsest first, each with the power of ten from it to nanoseconds.
TIME_UNITS = {"s": 9, "ms": 6, "us": 3}
_UNIT_NAMES = {"s": "seconds", "ms": "milliseconds", "us": "microseconds"}
# Offered rates no serving trace has: an import that seems to offer one most likely read its timestamps in the
# wrong unit (milliseconds read as seconds give a trace a thousand times too slow).
SLOWEST_RATE, LONG_SPAN_S, FASTEST_RATE = 0.01, 86400.0, 100_000.0
# Fractional seconds are split off before datetime parses the rest, which would cut them to microseconds.
_FRACTION = re.compile(r"(?<=\d\d:\d\d:\d\d)[.,](\d+)")


@dataclass(frozen=True)
class ImportOptions:
    max_prompt: int | None = None  # rows with longer prompts are dropped; None keeps every prompt
    max_budget: int | None = None  # longer outputs are clipped to this budget; None keeps every output whole
    window: tuple[float, float] | None = None  # keep [start, end) seconds after the file's first timestamp
    compress: float = 1.0  # arrival times are divided by this: 2 offers the same requests at twice the rate
    time_unit: str = "s"  # the unit of numeric timestamps (s, ms or us); ISO datetimes carry their own

    def __post_init__(self):
        for name in ("max_prompt", "max_budget"):
            _cap(name, getattr(self, name))
        if self.time_unit not in TIME_UNITS:
            raise InputError(f"the time unit must be one of {', '.join(TIME_UNITS)}, got {self.time_unit!r}")
        if not (math.isfinite(self.compress) and self.compress > 0):
            raise InputError(f"the time-compression factor must be a positive number, got {self.compress!r}")
        if self.window is not None:
            start, end = self.window
            if not (math.isfinite(start) and math.isfinite(end) and 0 <= start < end):
                raise InputError(f"the window {start}:{end} is empty: it needs 0 <= START < END seconds")


@dataclass(frozen=True)
class ImportReport:
    rows_read: int
    outside_window: int
    dropped_prompt: int  # prompts over max_prompt (counted among rows inside the window)
    clipped_budget: int  # kept rows whose output was cut to max_budget
    kept: int
    span_s: float  # first to last kept arrival, after compression
    offered_rate: float | None  # requests per second over that span

    def __str__(self) -> str:
        rate = "n/a" if self.offered_rate is None else f"{self.offered_rate:.3f} req/s"
        return "\n".join([
            f"rows read                  {self.rows_read}",
            f"outside the window         {self.outside_window}",
            f"dropped by the prompt cap  {self.dropped_prompt}",
            f"budgets clipped to the cap {self.clipped_budget}",
            f"rows kept                  {self.kept}",
            f"offered rate               {rate} over {self.span_s:.1f} s",
        ])


@dataclass(frozen=True)
class LengthsReport:
    rows_read: int
    dropped_prompt: int  # rows with prompts over max_prompt, never drawn
    pool: int  # rows left to draw from
    drawn: int  # requests in the trace
    clipped_budget: int  # drawn requests whose output was cut to max_budget
    span_s: float  # first to last arrival
    offered_rate: float | None  # requests per second over that span

    def __str__(self) -> str:
        rate = "n/a" if self.offered_rate is None else f"{self.offered_rate:.3f} req/s"
        return "\n".join([
            f"rows read                  {self.rows_read}",
            f"dropped by the prompt cap  {self.dropped_prompt}",
            f"rows drawn from            {self.pool}",
            f"requests drawn             {self.drawn}",
            f"budgets clipped to the cap {self.clipped_budget}",
            f"offered rate               {rate} over {self.span_s:.1f} s",
        ])


def _whole(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InputError(f"{name} must be a whole number >= {minimum}, got {value!r}")


def _cap(name: str, value) -> None:
    """A cap is None (none) or a whole number of tokens >= 1."""
    if value is not None:
        _whole(name, value, 1)


def _over(value: int, cap: int | None) -> bool:
    return cap is not None and value > cap


def _clip(value: int, cap: int | None) -> int:
    return value if cap is None else min(value, cap)


def import_azure(path: str | Path, options: ImportOptions = ImportOptions()) -> tuple[Trace, ImportReport]:
    """The Azure LLM inference trace 2023 (conversation or code CSV: TIMESTAMP, ContextTokens, GeneratedTokens)."""
    return import_table(path, *AZURE_COLUMNS, options=options, fmt="csv", kind="azure-llm-2023")


def import_mooncake(path: str | Path, options: ImportOptions = ImportOptions()) -> tuple[Trace, ImportReport]:
    """A Mooncake trace (FAST'25: JSON lines of timestamp in milliseconds, input_length, output_length and
    hash_ids, one per 512-token prompt block). Its timestamps are read as milliseconds, whatever options.time_unit
    says; every request keeps its hash ids (hash_block 512). A row whose ids are not one per block of its prompt
    (ceil(input_length / 512), the last block partial) is refused with its line: its hashes would say nothing."""
    return import_table(path, *MOONCAKE_COLUMNS, options=replace(options, time_unit="ms"), fmt="jsonl",
                        kind="mooncake", hashes=(MOONCAKE_HASHES, MOONCAKE_BLOCK))


def import_table(path: str | Path, timestamp: str, prompt: str, output: str, options: ImportOptions = ImportOptions(),
                 fmt: str | None = None, kind: str = "import",
                 hashes: tuple[str, int] | None = None) -> tuple[Trace, ImportReport]:
    """A CSV or JSONL file (by its suffix unless `fmt` says) whose named columns hold each request's arrival
    time (numbers in options.time_unit, or ISO datetimes), prompt tokens and output tokens; returns the trace
    and its cap report. With `hashes` (a column of JSON lists of ids, and the tokens per block), each request
    keeps its prompt's block hash ids."""
    path = Path(path)
    columns = (timestamp, prompt, output) + ((hashes[0],) if hashes else ())
    fmt, data, rows = _read_rows(path, fmt, columns)
    read = outside = dropped = clipped = 0
    kept: list[tuple[int, int, int, tuple[int, ...]]] = []  # (timestamp ns, prompt tokens, budget, hash ids)
    first = last = first_kind = None
    for line, (t, p, o, *h) in rows:
        read += 1
        ns, t_kind = _timestamp_ns(_text(t, path, line, timestamp), path, line, timestamp, options.time_unit)
        if first is None:
            first, first_kind = ns, t_kind
        elif t_kind != first_kind:  # neither numbers and datetimes, nor naive and zoned times, compare
            raise InputError(f"{t!r} is a {t_kind} timestamp, the file's first is a {first_kind} one",
                             path=path, row=line, column=timestamp)
        if last is not None and ns < last:
            raise InputError(f"{t!r} is earlier than the row before it: rows must be in arrival order",
                             path=path, row=line, column=timestamp)
        last = ns
        n_prompt = parse_int(_text(p, path, line, prompt), path, line, prompt, 1)
        n_output = parse_int(_text(o, path, line, output), path, line, output, 1)
        ids = _hash_ids(h[0], n_prompt, hashes, path, line) if hashes else ()
        if options.window and not options.window[0] * 1e9 <= ns - first < options.window[1] * 1e9:
            outside += 1
        elif _over(n_prompt, options.max_prompt):
            dropped += 1
        else:
            clipped += _over(n_output, options.max_budget)
            kept.append((ns, n_prompt, _clip(n_output, options.max_budget), ids))

    if not read:
        raise InputError("holds no requests", path=path)
    if not kept:
        why = (f"the window {options.window[0]}:{options.window[1]} s holds none of its rows" if outside == read
               else f"every prompt in it is over the cap of {options.max_prompt} tokens")
        raise InputError(f"no requests left: {why}", path=path)
    t0 = kept[0][0]
    trace = length_trace([((ns - t0) / 1e9 / options.compress, p, b) for ns, p, b, _ in kept],
                         hash_ids=[ids for *_, ids in kept] if hashes else None, hash_block=hashes[1] if hashes else 0)
    report = ImportReport(read, outside, dropped, clipped, len(kept), trace.span, trace.offered_rate)
    named = {"timestamp": timestamp, "prompt": prompt, "output": output, **({"hash_ids": hashes[0]} if hashes else {})}
    trace.meta = {
        "kind": kind,
        "source": {"file": path.name, "sha256": hashlib.sha256(data).hexdigest(), "format": fmt, "columns": named,
                   "timestamps": first_kind, **({"hash_block": hashes[1]} if hashes else {})},
        "options": asdict(options),
        "report": asdict(report),
    }
    return trace, report


def _hash_ids(value, prompt_tokens: int, hashes: tuple[str, int], path: Path, line: int) -> tuple[int, ...]:
    """A row's hash ids (a JSON list), refused with its line unless they are one whole number per prompt block."""
    column, block = hashes
    if not isinstance(value, list):
        shown = value if isinstance(value, str) else json.dumps(value)  # a number stays the text the file held
        raise InputError(f"{shown} is not a list of hash ids", path=path, row=line, column=column)
    ids = tuple(parse_hash_id(v, path, line, column) for v in value)
    why = hash_error(prompt_tokens, ids, block)
    if why:
        raise InputError(why, path=path, row=line, column=column)
    return ids


def import_note(meta: dict) -> str | None:
    """What an imported trace's import left out, as a line for a run's report: e.g. "412 of 3993 prompts over 4096
    tokens dropped, 957 of 3581 outputs clipped to 256 tokens", or "full lengths (no prompt or output cap)". None
    for a trace that was not imported (its metadata holds no import report)."""
    report, options = meta.get("report"), meta.get("options")
    if not (isinstance(report, dict) and isinstance(options, dict)):
        return None
    cap_p, cap_b = options.get("max_prompt"), options.get("max_budget")
    outside = report.get("outside_window", 0)  # a lengths import has no window, and draws its outputs
    parts = [f"{outside} of {report['rows_read']} rows outside the window left out"] if outside else []
    if cap_p is None and cap_b is None:
        return ", ".join(parts + ["full lengths (no prompt or output cap)"])
    parts.append("no prompt cap" if cap_p is None else
                 f"{report['dropped_prompt']} of {report['rows_read'] - outside} prompts over {cap_p} tokens dropped")
    outputs = f"{report['drawn']} drawn" if "drawn" in report else report["kept"]
    parts.append("no output cap" if cap_b is None else
                 f"{report['clipped_budget']} of {outputs} outputs clipped to {cap_b} tokens")
    return ", ".join(parts)


def time_unit_warning(trace: Trace) -> str | None:
    """A one-line "warning: ..." when an imported trace's offered rate is implausible for the unit its numeric
    timestamps were read in: under SLOWEST_RATE req/s over more than LONG_SPAN_S, or over FASTEST_RATE req/s.
    It names the unit that would fit. None when the rate is plausible or the timestamps were datetimes."""
    source, options = trace.meta.get("source", {}), trace.meta.get("options", {})
    if source.get("timestamps") != "numeric" or trace.offered_rate is None:
        return None
    # The file's own rate is judged: --compress changes the rate on purpose.
    rate, span = trace.offered_rate / options["compress"], trace.span * options["compress"]
    units = list(TIME_UNITS)
    unit = units.index(options["time_unit"])
    if rate < SLOWEST_RATE and span > LONG_SPAN_S:  # e.g. milliseconds read as seconds: try the next finer unit
        seen, other = f"{rate:.3g} req/s over {span / 86400:.1f} days", unit + 1
    elif rate > FASTEST_RATE:  # e.g. seconds read as milliseconds: try the next coarser unit
        seen, other = f"{rate:.3g} req/s", unit - 1
    else:
        return None
    hint = (f"if they are {_UNIT_NAMES[units[other]]}, import with --time-unit {units[other]}"
            if 0 <= other < len(units) else "check the unit of the timestamp column")
    return f"warning: the trace offers {seen} with its timestamps read as {_UNIT_NAMES[units[unit]]}; {hint}"


def import_lengths(path: str | Path, prompt: str, output: str, rate: float, n: int, seed: int = 0,
                   max_prompt: int | None = None, max_budget: int | None = None,
                   fmt: str | None = None) -> tuple[Trace, LengthsReport]:
    """A file of request lengths without arrival times (e.g. ShareGPT's prompt and output token counts) as a
    trace of n requests at `rate` per second; returns the trace and its report.

    Rows with prompts over max_prompt (when given) are dropped; n rows are drawn from the rest uniformly with
    replacement (workload.row_draw), their outputs clipped to max_budget (when given), and given the Poisson
    arrivals of workload.poisson_arrivals(rate, n, seed). Both come from raw PCG64 words (the same under every NumPy
    version) on separate streams, so the same (n, seed) holds the same requests at every rate.
    """
    path = Path(path)
    for name, value, minimum in (("n", n, 1), ("seed", seed, 0)):
        _whole(name, value, minimum)
    for name, cap in (("max_prompt", max_prompt), ("max_budget", max_budget)):
        _cap(name, cap)
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
        raise InputError(f"the arrival rate must be a positive number of requests per second, got {rate!r}")
    fmt, data, rows = _read_rows(path, fmt, (prompt, output))
    read = dropped = 0
    pool: list[tuple[int, int]] = []
    for line, (p, o) in rows:
        read += 1
        n_prompt = parse_int(_text(p, path, line, prompt), path, line, prompt, 1)
        n_output = parse_int(_text(o, path, line, output), path, line, output, 1)
        if _over(n_prompt, max_prompt):
            dropped += 1
        else:
            pool.append((n_prompt, n_output))
    if not read:
        raise InputError("holds no requests", path=path)
    if not pool:
        raise InputError(f"no requests left: every prompt in it is over the cap of {max_prompt} tokens", path=path)

    drawn = [pool[i] for i in row_draw(len(pool), n, seed)]
    trace = length_trace([(a, p, _clip(o, max_budget)) for a, (p, o) in zip(poisson_arrivals(rate, n, seed), drawn)])
    report = LengthsReport(read, dropped, len(pool), n, sum(_over(o, max_budget) for _, o in drawn), trace.span,
                           trace.offered_rate)
    trace.meta = {
        "kind": "lengths",
        "source": {"file": path.name, "sha256": hashlib.sha256(data).hexdigest(), "format": fmt,
                   "columns": {"prompt": prompt, "output": output}},
        "options": {"max_prompt": max_prompt, "max_budget": max_budget, "rate": rate, "n": n, "seed": seed},
        "report": asdict(report),
    }
    return trace, report


def _read_rows(path: Path, fmt: str | None, columns: tuple[str, ...]) -> tuple[str, bytes, Iterator[tuple[int, list]]]:
    """The format (from the suffix unless `fmt` says), the file's bytes (for its hash) and its rows' named values."""
    fmt = fmt or ("jsonl" if path.suffix.lower() in (".jsonl", ".ndjson") else "csv")
    if fmt not in FORMATS:
        raise InputError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}", path=path)
    data = read_bytes(path)
    text = decode_text(data, path, "utf-8-sig")  # a spreadsheet's byte-order mark is not part of the first column
    return fmt, data, (_csv_rows if fmt == "csv" else _jsonl_rows)(text, path, columns)


def _csv_rows(text: str, path: Path, columns: tuple[str, ...]) -> Iterator[tuple[int, list[str]]]:
    """(line number, the named columns' values) for each data row of a CSV with a header line."""
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    try:
        header = next(reader, None)
        if header is None:
            raise InputError("is empty", path=path)
        _require(columns, header, path, 1)
        idx = [header.index(c) for c in columns]
        for r in reader:
            if not r:  # a blank line holds no row
                continue
            if len(r) != len(header):
                raise InputError(f"has {len(r)} fields, the header has {len(header)}", path=path, row=reader.line_num)
            yield reader.line_num, [r[i] for i in idx]
    except csv.Error as e:
        raise InputError(f"is not valid CSV ({e})", path=path, row=reader.line_num) from None


def _jsonl_rows(text: str, path: Path, columns: tuple[str, ...]) -> Iterator[tuple[int, list]]:
    """(line number, the named fields' values) for each object of a JSON-lines file. Numbers stay text so
    that they are parsed exactly as a CSV's are."""
    for line, raw in enumerate(io.StringIO(text), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw, parse_int=str, parse_float=str, parse_constant=str)
        except json.JSONDecodeError as e:
            raise InputError(f"is not valid JSON ({e.msg})", path=path, row=line) from None
        if not isinstance(obj, dict):
            raise InputError("is not a JSON object", path=path, row=line)
        _require(columns, obj, path, line)
        yield line, [obj[c] for c in columns]


def _require(columns: tuple[str, ...], present, path: Path, line: int) -> None:
    for c in columns:
        if c not in present:
            raise InputError(f"no such column; found {', '.join(present)}", path=path, row=line, column=c)


def _text(value, path: Path, line: int, column: str) -> str:
    # JSON may hold true, null or a list where a number or a timestamp belongs.
    if not isinstance(value, str):
        raise InputError(f"{json.dumps(value)} is not a number or a timestamp", path=path, row=line, column=column)
    return value


def _timestamp_ns(value: str, path: Path, line: int, column: str, unit: str) -> tuple[int, str]:
    """The time in integer nanoseconds (exact, unlike float seconds since 1970), and what kind of timestamp
    it is: 'numeric' (a number in `unit`), 'naive' or 'zoned' (an ISO datetime without or with a UTC offset)."""
    value = value.strip()
    try:
        number = Decimal(value)
    except InvalidOperation:
        number = None
    if number is not None:
        # Past 1e20 (three trillion years in seconds) is no time, and 1e999999 would take minutes to convert.
        if not number.is_finite() or number.adjusted() > 20:
            raise InputError(f"{value!r} is not a time", path=path, row=line, column=column)
        return int(number.scaleb(TIME_UNITS[unit]).to_integral_value()), "numeric"
    frac = _FRACTION.search(value)
    try:
        dt = datetime.fromisoformat(value if frac is None else value[:frac.start()] + value[frac.end():])
    except ValueError:
        raise InputError(f"{value!r} is neither a number nor an ISO datetime", path=path, row=line,
                         column=column) from None
    epoch = datetime(1970, 1, 1, tzinfo=timezone.utc if dt.tzinfo else None)
    ns = (dt - epoch) // timedelta(microseconds=1) * 1000 + (int(frac.group(1)[:9].ljust(9, "0")) if frac else 0)
    return ns, "naive" if dt.tzinfo is None else "zoned"
