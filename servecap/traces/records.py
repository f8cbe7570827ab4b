"""Run records, one schema for real and simulated runs.

A run is a directory: meta.json (how and where it was made, the schema and version, the tables and their
columns), requests.csv, steps.csv, tokens.csv and rejected.csv (a finished record may keep any of them gzipped,
NAME.csv.gz). Rows are appended and flushed as they complete, so a run killed halfway keeps every finished row;
meta.json says "running" until the run closes it.

Version 3 moved each table's header line (`# {"schema": "run-record/requests", "version": 2}`) into meta.json:
the tables are plain CSV, which `pandas.read_csv` reads as it is (a header line it takes for the column names
gives a frame of one garbage column unless told comment='#'). Versions 1 and 2, with the line, are still read.

Version 2 adds to each prefill step the positions it computed (`tokens`: padding included) and its causal
attention work (`attn`, servecap/costs/shapes.py), and the replica that ran each request and step. Version-1 records
are still read: their prefill steps were padded groups, whose tokens and work follow from rows x padded_len.
Version 4 names a step's count of admitted requests n_admitted (it was `admitted`, the name of a time in
requests.csv); older records read with the new name.
"""
from __future__ import annotations

import json
from array import array
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import pandas as pd

from .csvio import AppendWriter, atomic_write_text, read_frame, read_table, read_text
from .errors import InputError
from .provenance import now_iso

SCHEMA = "run-record"
VERSION = 5
READS = (1, 2, 3, 4, 5)
HEADED = (1, 2)  # versions whose tables start with a '# {"schema": ...}' line
REQUEST_COLUMNS = ("request_id", "arrival", "admitted", "admit_step", "group_id", "group_size", "first_token",
                   "finished", "prompt_tokens", "output_tokens", "blocks", "replica", "preemptions",
                   "recomputed_tokens", "cached_tokens")


class StepRow(NamedTuple):
    """One row of steps.csv: a prefill step (its rows, padded length, prompt positions, positions computed and
    attention work; its admission group and how many requests the pass admitted), a decode step (its rows' K/V
    tokens, the longest row's, what its attention read, and how many rows retired after it), or a fused step
    (`mixed`: a prefill step whose first `decode_rows` sequences are decode rows, their K/V as a decode step's).
    `preempted`: requests preempted at the start of the step's pass; `recomputed`: positions it computes again
    that a preemption lost."""

    step: int
    kind: str  # "prefill", "decode" or "mixed"
    rows: int
    padded_len: int
    prompt_tokens: int
    tokens: int
    attn: int
    kv_tokens: int
    kv_max: int
    kv_read: int
    start: float
    end: float
    group_id: int  # -1 for a decode step
    n_admitted: int
    retired: int
    replica: int
    preempted: int
    recomputed: int
    decode_rows: int


STEP_COLUMNS = StepRow._fields
_RENAMED = {("steps", "n_admitted"): ("admitted", 4)}  # (table, column): (its name before, the version renaming it)
_ADDED = {"requests": ("replica",), "steps": ("tokens", "attn", "replica")}  # columns version 2 added
# Columns version 5 added (preemption, prefix caching, fused steps), 0 in an older record: it had none of them.
_ADDED_V5 = {"requests": ("preemptions", "recomputed_tokens", "cached_tokens"),
             "steps": ("preempted", "recomputed", "decode_rows")}
TOKEN_COLUMNS = ("request_id", "index", "time", "token_id")  # token_id -1 where not known (simulated)
REJECTED_COLUMNS = ("request_id", "arrival", "reason")
TABLES = {"requests": REQUEST_COLUMNS, "steps": STEP_COLUMNS, "tokens": TOKEN_COLUMNS, "rejected": REJECTED_COLUMNS}
_FAST = ("requests", "steps", "tokens")  # the large tables, read by pandas' parser (rejected: a few rows of text)
_NUMERIC = {"requests": REQUEST_COLUMNS, "steps": tuple(c for c in STEP_COLUMNS if c != "kind"),
            "tokens": TOKEN_COLUMNS, "rejected": ("request_id", "arrival")}


@dataclass
class RunRecord:
    meta: dict
    requests: pd.DataFrame
    steps: pd.DataFrame
    tokens: pd.DataFrame
    rejected: pd.DataFrame


class RunWriter:
    """Collects a run's rows: appended to files under `out_dir`, or kept in memory when out_dir is None."""

    def __init__(self, out_dir: str | Path | None, meta: dict, tables=("requests", "steps", "tokens", "rejected")):
        self.meta = {**meta, "schema": SCHEMA, "version": VERSION,
                     "tables": {t: list(TABLES[t]) for t in tables}, "status": "running"}
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self._mem: dict[str, list] = {}
        self._files: dict[str, AppendWriter] = {}
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            if any((self.out_dir / f"{t}.csv").exists() for t in TABLES):
                raise InputError("already holds a run record; choose a new output directory", path=self.out_dir)
            self._write_meta()
            self._files = {t: AppendWriter(self.out_dir / f"{t}.csv", TABLES[t]) for t in tables}
        else:
            self._mem = {t: _Columns() for t in tables}

    def _write_meta(self) -> None:
        atomic_write_text(self.out_dir / "meta.json", json.dumps(self.meta, indent=2, sort_keys=True, default=str) + "\n")

    def add(self, table: str, row) -> None:
        self.adder(table)(row)

    def adder(self, table: str) -> Callable[[tuple], None]:
        """add(table, row) for one table, the table looked up once: a recorder adds rows at every step."""
        if table in self._files:
            return self._files[table].write
        if table in self._mem:
            return self._mem[table].add
        return lambda row: None  # a table this run does not keep

    def add_many(self, table: str, rows) -> None:
        if table in self._files:
            self._files[table].write_many(rows)
        elif table in self._mem:
            self._mem[table].add_many(rows)

    def close(self, **summary) -> None:
        self.meta.update(summary, status="complete", ended_at=now_iso())
        if self.out_dir is not None:
            for f in self._files.values():
                f.close()
            self._write_meta()

    def record(self) -> RunRecord:
        """The run as data frames (from memory, or re-read from its files)."""
        if self.out_dir is not None:
            return read_run(self.out_dir)
        frames = {t: self._mem[t].frame(t) if t in self._mem else _empty(t) for t in TABLES}
        return RunRecord(dict(self.meta), **frames)


class _Columns:
    """A table's rows kept in memory (a simulated run's), column by column: each full chunk of rows is packed into
    a typed array per column where every value is a Python int (int64) or every one a float (float64), so a long
    run holds 8 bytes a number instead of a tuple of Python objects. A column with any other value (a string,
    None, a mix) stays a list of its objects. frame() is the frame pandas makes of the rows, dtypes and values."""

    CHUNK = 4096

    def __init__(self):
        self._rows: list[tuple] = []  # rows not yet packed
        self._cols: list[array | list] | None = None
        self._n = 0  # rows packed

    def add(self, row: tuple) -> None:
        self._rows.append(row)
        if len(self._rows) >= self.CHUNK:
            self._pack()

    def add_many(self, rows) -> None:
        self._rows.extend(rows)
        if len(self._rows) >= self.CHUNK:
            self._pack()

    def _pack(self) -> None:
        rows, self._rows = self._rows, []
        if not rows:
            return
        cols = list(zip(*rows))
        if self._cols is None:
            self._cols = [_packed(c) for c in cols]
        else:
            for i, c in enumerate(cols):
                kept, more = self._cols[i], _packed(c)
                if isinstance(kept, list) or (isinstance(more, array) and kept.typecode == more.typecode):
                    kept.extend(more)
                else:  # kinds differ (ints then floats, say): objects, as pandas would see them
                    self._cols[i] = list(kept) + list(more)
        self._n += len(rows)

    def frame(self, table: str) -> pd.DataFrame:
        self._pack()
        if self._cols is None:
            return _empty(table)
        columns = TABLES[table]
        objects = [i for i, c in enumerate(self._cols) if not isinstance(c, array)]
        # Object columns go the way the rows went before: pandas infers each column of a frame of rows on its own.
        inferred = pd.DataFrame(list(zip(*(self._cols[i] for i in objects))) if objects else [],
                                columns=[columns[i] for i in objects])
        data = {c: inferred[c] if not isinstance(col, array) else
                np.frombuffer(col, np.int64 if col.typecode == "q" else np.float64)
                for c, col in zip(columns, self._cols)}
        return _frame(table, data)


@lru_cache(maxsize=None)
def _empty_frame(table: str) -> pd.DataFrame:
    return _frame(table, [])


def _empty(table: str) -> pd.DataFrame:
    """A table with no rows, as _frame makes it; a copy of one made once (making it costs a simulated point ~1 ms)."""
    return _empty_frame(table).copy()


def _packed(values: tuple) -> array | list:
    """A chunk of one column: an int64 or float64 array when every value is a Python int, or every one a float
    (exactly: a bool or a numpy number is not one); else the values."""
    kinds = set(map(type, values))
    try:
        if kinds == {int}:
            return array("q", values)
        if kinds == {float}:
            return array("d", values)
    except OverflowError:  # an int beyond int64
        pass
    return list(values)


def _frame(table: str, rows: list | dict, columns: tuple[str, ...] | None = None) -> pd.DataFrame:
    columns = columns or TABLES[table]
    df = pd.DataFrame(rows, columns=list(columns))
    numeric = _NUMERIC[table]
    for c, dtype in df.dtypes.items():
        if c in numeric and dtype.kind not in "iuf":  # a numeric column would come back as it is, at a cost
            df[c] = pd.to_numeric(df[c])
    return df


def read_run(run_dir: str | Path) -> RunRecord:
    """Read a run directory; a run cut off mid-way reads as far as its last complete row."""
    run_dir = Path(run_dir)
    meta_path = run_dir / "meta.json"
    if not meta_path.exists():
        raise InputError("not a run record (no meta.json)", path=run_dir)
    try:
        meta = json.loads(read_text(meta_path))
    except json.JSONDecodeError as e:
        raise InputError(f"is not valid JSON ({e})", path=meta_path) from None
    if not isinstance(meta, dict):
        raise InputError("is not a JSON object", path=meta_path)
    version = meta.get("version")
    if meta.get("schema") != SCHEMA or version not in READS:
        raise InputError(f"run-record schema {meta.get('schema')!r} v{version!r} is not {SCHEMA!r} "
                         f"v{' or v'.join(map(str, READS))}", path=meta_path)
    frames = {}
    for t, cols in TABLES.items():
        p = run_dir / f"{t}.csv"
        if not p.exists() and p.with_name(f"{t}.csv.gz").exists():  # a finished record, compressed for keeping
            p = p.with_name(f"{t}.csv.gz")
        old = version == 1 and t in _ADDED
        zero = _ADDED_V5.get(t, ()) if version < 5 else ()
        want = tuple(c for c in cols if c not in zero and not (old and c in _ADDED[t]))
        # A renamed column is read under the name its version wrote, and goes on under its current name.
        named = tuple(_RENAMED[t, c][0] if (t, c) in _RENAMED and version < _RENAMED[t, c][1] else c for c in want)
        schema = f"{SCHEMA}/{t}" if version in HEADED else None
        rows = None
        if p.exists() and t in _FAST:
            rows = read_frame(p, schema, (version,), named,
                              numeric=[n for c, n in zip(want, named) if c in _NUMERIC[t]], appended=True)
            if rows is not None:
                rows = rows.set_axis(list(want), axis=1)
        if rows is None:
            rows = read_table(p, schema, (version,), named, appended=True)[1] if p.exists() else []
        try:
            frame = _frame(t, rows, want)
            if zero:
                frame = frame.assign(**{c: 0 for c in zero})
            frames[t] = _upgrade(t, frame) if old else frame[list(cols)]
        except ValueError:  # pandas' message names neither the file nor the line
            raise _not_a_number(p, t, rows, want, headed=schema is not None) from None
    return RunRecord(meta, **frames)


def _not_a_number(path: Path, table: str, rows: list[list[str]], columns: tuple[str, ...], headed: bool) -> InputError:
    """The first value of a numeric column that is not a number, by file line (the column names' line first, after
    the header line of a version-1 or -2 record)."""
    df = pd.DataFrame(rows, columns=list(columns))
    for c in (c for c in columns if c in _NUMERIC[table]):
        bad = pd.to_numeric(df[c], errors="coerce").isna() & (df[c].str.strip() != "")
        if bad.any():
            i = int(np.argmax(bad.to_numpy()))
            return InputError(f"{df[c].iloc[i]!r} is not a number", path=path, row=i + (3 if headed else 2), column=c)
    return InputError("holds a value that is not a number", path=path)


def is_complete(run_dir: str | Path) -> bool:
    """Whether run_dir holds a record its run closed (an interrupted run's is made again)."""
    meta = Path(run_dir) / "meta.json"
    return meta.exists() and json.loads(meta.read_text()).get("status") == "complete"


def unfinished(rec: RunRecord) -> str | None:
    """What to warn about a record whose run never closed it (killed, or still running); None for a closed one."""
    status = rec.meta.get("status")
    if status == "complete":
        return None
    return (f"the record is unfinished (status {status!r}): it holds the run up to its last finished request; "
            f"requests still queued or running then are not in it")


def _upgrade(table: str, df: pd.DataFrame) -> pd.DataFrame:
    """A version-1 frame with version 2's columns."""
    df = df.assign(replica=0)
    if table == "steps":
        prefill = df["kind"] == "prefill"
        df = df.assign(tokens=(df["rows"] * df["padded_len"]).where(prefill, 0),
                       attn=(df["rows"] * df["padded_len"] ** 2).where(prefill, 0))
    return df[list(TABLES[table])]
