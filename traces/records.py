"""Run records, one schema for real and simulated runs.

A run is a directory: meta.json (how and where it was made), requests.csv, steps.csv, tokens.csv and
rejected.csv (a finished record may keep any of them gzipped, NAME.csv.gz). Rows are appended and flushed as they complete, so a run killed halfway keeps every
finished row; meta.json says "running" until the run closes it.

Version 2 adds to each prefill step the positions it computed (`tokens`: padding included) and its causal
attention work (`attn`, costs/shapes.py), and the replica that ran each request and step. Version-1 records
are still read: their prefill steps were padded groups, whose tokens and work follow from rows x padded_len.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from .csvio import AppendWriter, atomic_write_text, read_table, read_text
from .errors import InputError
from .provenance import now_iso

SCHEMA = "run-record"
VERSION = 2
READS = (1, 2)
REQUEST_COLUMNS = ("request_id", "arrival", "admitted", "admit_step", "group_id", "group_size", "first_token",
                   "finished", "prompt_tokens", "output_tokens", "blocks", "replica")
STEP_COLUMNS = ("step", "kind", "rows", "padded_len", "prompt_tokens", "tokens", "attn", "kv_tokens", "kv_max",
                "kv_read", "start", "end", "group_id", "admitted", "retired", "replica")
_ADDED = {"requests": ("replica",), "steps": ("tokens", "attn", "replica")}  # columns version 2 added
TOKEN_COLUMNS = ("request_id", "index", "time", "token_id")  # token_id -1 where not known (simulated)
REJECTED_COLUMNS = ("request_id", "arrival", "reason")
TABLES = {"requests": REQUEST_COLUMNS, "steps": STEP_COLUMNS, "tokens": TOKEN_COLUMNS, "rejected": REJECTED_COLUMNS}
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
        self.meta = {"schema": SCHEMA, "version": VERSION, **meta, "status": "running"}
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self._mem: dict[str, list] = {}
        self._files: dict[str, AppendWriter] = {}
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            if any((self.out_dir / f"{t}.csv").exists() for t in TABLES):
                raise InputError("already holds a run record; choose a new output directory", path=self.out_dir)
            self._write_meta()
            self._files = {t: AppendWriter(self.out_dir / f"{t}.csv", f"{SCHEMA}/{t}", VERSION, TABLES[t]) for t in tables}
        else:
            self._mem = {t: [] for t in tables}

    def _write_meta(self) -> None:
        atomic_write_text(self.out_dir / "meta.json", json.dumps(self.meta, indent=2, sort_keys=True, default=str) + "\n")

    def add(self, table: str, row) -> None:
        if table in self._files:
            self._files[table].write(row)
        elif table in self._mem:
            self._mem[table].append(row)

    def add_many(self, table: str, rows) -> None:
        if table in self._files:
            self._files[table].write_many(rows)
        elif table in self._mem:
            self._mem[table].extend(rows)

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
        frames = {t: _frame(t, self._mem.get(t, [])) for t in TABLES}
        return RunRecord(dict(self.meta), **frames)


def _frame(table: str, rows: list, columns: tuple[str, ...] | None = None) -> pd.DataFrame:
    columns = columns or TABLES[table]
    df = pd.DataFrame(rows, columns=list(columns))
    for c in _NUMERIC[table]:
        if c in df:
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
        want = tuple(c for c in cols if c not in _ADDED[t]) if old else cols
        rows = read_table(p, f"{SCHEMA}/{t}", (version,), want, appended=True)[1] if p.exists() else []
        frames[t] = _upgrade(t, _frame(t, rows, want)) if old else _frame(t, rows)
    return RunRecord(meta, **frames)


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
