"""Public request traces (arrival times and token lengths in a CSV or JSONL file) as workload traces.

Each row is kept or removed by an explicit option (the time window, the prompt cap) and counted in the
report; a malformed row is refused with its file, line and column, never skipped. The report, the
options and the source file's hash go into the trace's metadata, so a trace file says where it came from.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import re
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Iterator

from .csvio import parse_int
from .errors import InputError
from .workload import Trace, length_trace

MAX_PROMPT = 4096
MAX_BUDGET = 256
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
FORMATS = ("csv", "jsonl")
# Fractional seconds are split off before datetime parses the rest, which would cut them to microseconds.
_FRACTION = re.compile(r"(?<=\d\d:\d\d:\d\d)[.,](\d+)")


@dataclass(frozen=True)
class ImportOptions:
    max_prompt: int = MAX_PROMPT  # rows with longer prompts are dropped
    max_budget: int = MAX_BUDGET  # longer outputs are clipped to this budget
    window: tuple[float, float] | None = None  # keep [start, end) seconds after the file's first timestamp
    compress: float = 1.0  # arrival times are divided by this: 2 offers the same requests at twice the rate

    def __post_init__(self):
        for name in ("max_prompt", "max_budget"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be a whole number >= 1, got {value!r}")
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


def import_azure(path: str | Path, options: ImportOptions = ImportOptions()) -> tuple[Trace, ImportReport]:
    """The Azure LLM inference trace 2023 (conversation or code CSV: TIMESTAMP, ContextTokens, GeneratedTokens)."""
    return import_table(path, *AZURE_COLUMNS, options=options, fmt="csv", kind="azure-llm-2023")


def import_table(path: str | Path, timestamp: str, prompt: str, output: str, options: ImportOptions = ImportOptions(),
                 fmt: str | None = None, kind: str = "import") -> tuple[Trace, ImportReport]:
    """A CSV or JSONL file (by its suffix unless `fmt` says) whose named columns hold each request's arrival
    time (seconds, or ISO datetimes), prompt tokens and output tokens; returns the trace and its cap report."""
    path = Path(path)
    fmt = fmt or ("jsonl" if path.suffix.lower() in (".jsonl", ".ndjson") else "csv")
    if fmt not in FORMATS:
        raise InputError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}", path=path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise InputError(f"cannot read the file ({e.strerror})", path=path) from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise InputError(f"is not UTF-8 text (byte {e.start})", path=path) from None

    rows = (_csv_rows if fmt == "csv" else _jsonl_rows)(text, path, (timestamp, prompt, output))
    read = outside = dropped = clipped = 0
    kept: list[tuple[int, int, int]] = []  # (timestamp ns, prompt tokens, budget)
    first = last = first_kind = None
    for line, (t, p, o) in rows:
        read += 1
        ns, t_kind = _timestamp_ns(_text(t, path, line, timestamp), path, line, timestamp)
        if first is None:
            first, first_kind = ns, t_kind
        elif t_kind != first_kind:  # neither seconds and datetimes, nor naive and zoned times, compare
            raise InputError(f"{t!r} is a {t_kind} timestamp, the file's first is a {first_kind} one",
                             path=path, row=line, column=timestamp)
        if last is not None and ns < last:
            raise InputError(f"{t!r} is earlier than the row before it: rows must be in arrival order",
                             path=path, row=line, column=timestamp)
        last = ns
        n_prompt = parse_int(_text(p, path, line, prompt), path, line, prompt, 1)
        n_output = parse_int(_text(o, path, line, output), path, line, output, 1)
        if options.window and not options.window[0] * 1e9 <= ns - first < options.window[1] * 1e9:
            outside += 1
        elif n_prompt > options.max_prompt:
            dropped += 1
        else:
            clipped += n_output > options.max_budget
            kept.append((ns, n_prompt, min(n_output, options.max_budget)))

    if not read:
        raise InputError("holds no requests", path=path)
    if not kept:
        why = (f"the window {options.window[0]}:{options.window[1]} s holds none of its rows" if outside == read
               else f"every prompt in it is over the cap of {options.max_prompt} tokens")
        raise InputError(f"no requests left: {why}", path=path)
    t0 = kept[0][0]
    trace = length_trace([((ns - t0) / 1e9 / options.compress, p, b) for ns, p, b in kept])
    report = ImportReport(read, outside, dropped, clipped, len(kept), trace.span, trace.offered_rate)
    trace.meta = {
        "kind": kind,
        "source": {"file": path.name, "sha256": hashlib.sha256(data).hexdigest(), "format": fmt,
                   "columns": {"timestamp": timestamp, "prompt": prompt, "output": output}},
        "options": asdict(options),
        "report": asdict(report),
    }
    return trace, report


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


def _timestamp_ns(value: str, path: Path, line: int, column: str) -> tuple[int, str]:
    """The time in integer nanoseconds (exact, unlike float seconds since 1970), and what kind of timestamp
    it is: 'seconds', 'naive' or 'zoned' (an ISO datetime without or with a UTC offset)."""
    value = value.strip()
    try:
        seconds = Decimal(value)
    except InvalidOperation:
        seconds = None
    if seconds is not None:
        if not seconds.is_finite():
            raise InputError(f"{value!r} is not a time", path=path, row=line, column=column)
        return int(seconds.scaleb(9).to_integral_value()), "seconds"
    frac = _FRACTION.search(value)
    try:
        dt = datetime.fromisoformat(value if frac is None else value[:frac.start()] + value[frac.end():])
    except ValueError:
        raise InputError(f"{value!r} is neither seconds nor an ISO datetime", path=path, row=line,
                         column=column) from None
    epoch = datetime(1970, 1, 1, tzinfo=timezone.utc if dt.tzinfo else None)
    ns = (dt - epoch) // timedelta(microseconds=1) * 1000 + (int(frac.group(1)[:9].ljust(9, "0")) if frac else 0)
    return ns, "naive" if dt.tzinfo is None else "zoned"
