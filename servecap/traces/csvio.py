"""CSV files, and the one-line JSON header that names a standalone file's schema and version.

A request trace starts with `# {"schema": ..., "version": ...}` so a reader can refuse files it does not
understand instead of misreading them. A run record's tables are plain CSV (their schema and version are in the
record's meta.json), so pandas reads them as they are; records made before version 3 carry the header line too.
"""
from __future__ import annotations

import contextlib
import csv
import gzip
import io
import json
import os
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from .errors import InputError
from .outpath import refuse_special, write_error

INT64_MAX = 2 ** 63 - 1


def header_line(schema: str, version: int, meta: dict | None = None) -> str:
    return "# " + json.dumps({"schema": schema, "version": version, **(meta or {})}, sort_keys=True) + "\n"


def parse_header(line: str, path: Path, schema: str, versions: Sequence[int]) -> dict:
    if not line.startswith("# "):
        raise InputError(f"missing the '# {{\"schema\": \"{schema}\", ...}}' header line", path=path, row=1)
    try:
        meta = json.loads(line[2:])
    except (json.JSONDecodeError, RecursionError) as e:  # RecursionError: brackets nested thousands deep
        raise InputError(f"header line is not valid JSON ({e})", path=path, row=1) from None
    if not isinstance(meta, dict):
        raise InputError("header line is not a JSON object", path=path, row=1)
    if meta.get("schema") != schema:
        raise InputError(f"is a {meta.get('schema')!r} file, expected {schema!r}", path=path, row=1)
    if meta.get("version") not in versions:
        raise InputError(
            f"schema version {meta.get('version')!r} is not one this reader knows ({', '.join(map(str, versions))})",
            path=path, row=1)
    return meta


def atomic_write_text(path: Path, text: str) -> None:
    """Write a whole file so that a reader never sees half of it, and leave no temporary file if that fails. The
    rename replaces only a regular file (outpath.refuse_special)."""
    path = Path(path)
    refuse_special(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:  # a full disk, a read-only filesystem, a file in the way: say so of the file asked for
        with contextlib.suppress(OSError):  # its directory may not exist, or be a file
            tmp.unlink(missing_ok=True)
        raise write_error(path, e) from None
    except BaseException:  # Ctrl-C
        tmp.unlink(missing_ok=True)
        raise


def write_table(path: Path, schema: str, version: int, columns: Sequence[str], rows: Iterable[Sequence],
                meta: dict | None = None) -> None:
    buf = io.StringIO()
    buf.write(header_line(schema, version, meta))
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(columns)
    w.writerows(rows)
    atomic_write_text(path, buf.getvalue())


class AppendWriter:
    """Appends rows to a plain CSV (a line of column names, then rows) and flushes each one, so a killed process
    keeps every completed row.

    Read such a file with read_table(..., schema=None, appended=True), which drops a last row cut off mid-write.
    """

    def __init__(self, path: Path, columns: Sequence[str]):
        self.path = Path(path)
        self.columns = list(columns)
        fresh = not self.path.exists() or self.path.stat().st_size == 0
        self._f = open(self.path, "a", newline="", encoding="utf-8")
        self._w = csv.writer(self._f, lineterminator="\n")
        if fresh:
            self._w.writerow(self.columns)
            self._f.flush()

    def write(self, row: Sequence) -> None:
        self._w.writerow(row)
        self._f.flush()

    def write_many(self, rows: Iterable[Sequence]) -> None:
        self._w.writerows(rows)
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_bytes(path: Path) -> bytes:
    """A whole file's bytes (a .gz file's decompressed: committed records keep their large tables so), or an
    InputError saying why they cannot be read."""
    try:
        data = Path(path).read_bytes()
        return gzip.decompress(data) if Path(path).suffix == ".gz" else data
    except FileNotFoundError:
        raise InputError("file not found", path=path) from None
    except IsADirectoryError:
        raise InputError("is a directory, not a file", path=path) from None
    except (OSError, EOFError) as e:  # gzip's errors are OSErrors too, or EOF for a cut-off file
        raise InputError(f"cannot read the file ({getattr(e, 'strerror', None) or e})", path=path) from None


def decode_text(data: bytes, path: Path, encoding: str = "utf-8") -> str:
    """`data` as text, or an InputError naming the line and byte offset of the first byte that is not UTF-8."""
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise InputError(f"is not UTF-8 text (byte {e.start})", path=path, row=line) from None


def read_text(path: Path) -> str:
    """A whole UTF-8 text file, or an InputError: missing, a directory, unreadable or not UTF-8."""
    return decode_text(read_bytes(path), path)


def read_table(path: Path, schema: str | None, versions: Sequence[int],
               columns: Sequence[str] | Mapping[int, Sequence[str]], *,
               appended: bool = False) -> tuple[dict, list[list[str]]]:
    """Header metadata and the data rows as strings, holding `columns` in that order (a mapping picks them by the
    header line's version: a later version may add columns); a malformed row is refused with its line. schema=None
    reads a plain CSV, without the header line (its metadata then is {}).

    `appended` is for files written row by row (AppendWriter): a last line without its newline there is a
    row cut off when the writing process died, and is dropped. Every other file is written whole
    (atomic_write_text), so its last line is a row like any other, with or without a newline.
    """
    path = Path(path)
    text = read_text(path)
    if appended and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]  # the process died mid-row: keep only whole rows
    # Split on newlines only: str.splitlines also breaks at \u2028, \x1c and the like, which may sit inside a field.
    lines = io.StringIO(text).readlines()
    if not lines:
        raise InputError("file is empty", path=path)
    skip = 0 if schema is None else 1  # the header line
    meta = {} if schema is None else parse_header(lines[0], path, schema, versions)
    if isinstance(columns, Mapping):
        columns = columns[meta["version"]]
    reader = csv.reader(lines[skip:], strict=True)  # reader.line_num + skip is the file's line
    try:
        header = next(reader, None)
        if header is None:
            raise InputError("no column header line", path=path, row=1 + skip)
        missing = [c for c in columns if c not in header]
        if missing:
            raise InputError(f"missing columns {missing}; found {header}", path=path, row=1 + skip)
        idx = [header.index(c) for c in columns]
        out = []
        for r in reader:
            if len(r) != len(header):
                raise InputError(f"has {len(r)} fields, the header has {len(header)}", path=path,
                                 row=reader.line_num + skip)
            out.append([r[j] for j in idx])
    except csv.Error as e:
        raise InputError(f"is not valid CSV ({e})", path=path, row=reader.line_num + skip) from None
    return meta, out


def read_frame(path: Path, schema: str | None, versions: Sequence[int], columns: Sequence[str], *,
               numeric: Sequence[str], appended: bool = False):
    """The table as a data frame by pandas' C parser, when that reading is the one read_table's rows give: every
    row whole (its last field there) and every `numeric` column all numbers; None otherwise, for read_table to
    find the problem and name its line. Tens of times faster than read_table for a large table.

    Floats are parsed exactly (the shortest repr a writer wrote reads back as the same double); only "nan" and
    the empty field are missing values, as the writers write them."""
    import pandas as pd
    data = read_bytes(path)
    if appended:
        data = data[: data.rfind(b"\n") + 1]  # a row cut off mid-write, as read_table drops it
    skip = 0
    if schema is not None:
        parse_header(decode_text(data.partition(b"\n")[0], path), path, schema, versions)
        skip = 1
    # pandas 3 parses floats exactly by default (and deprecates asking); pandas 2 only when asked
    exact = {} if int(pd.__version__.split(".")[0]) >= 3 else {"float_precision": "round_trip"}
    try:
        df = pd.read_csv(io.BytesIO(data), skiprows=skip, engine="c", encoding="utf-8", keep_default_na=False,
                         na_values=["nan", ""], **exact)
    except (ValueError, UnicodeDecodeError, pd.errors.ParserError, pd.errors.EmptyDataError):
        return None
    if df.empty or any(c not in df.columns for c in columns) or df[df.columns[-1]].isna().any():
        return None  # a short row leaves the last field missing
    if any(df[c].dtype.kind not in "iuf" for c in numeric):
        return None
    return df[list(columns)]


def parse_int(value: str, path: Path, line: int, column: str, minimum: int) -> int:
    """A whole number (written as 12, 12.0 or 1.2e1) of at least `minimum`, or an InputError naming where it is.
    Read as a decimal, not a float: an id above 2**53 keeps every digit, and two such ids never collide."""
    try:
        d = Decimal(value.strip())
    except InvalidOperation:
        raise InputError(f"{value!r} is not a number", path=path, row=line, column=column) from None
    if not d.is_finite() or d != d.to_integral_value():
        raise InputError(f"{value!r} is not a whole number", path=path, row=line, column=column)
    if d < minimum:
        raise InputError(f"{value!r} must be at least {minimum}", path=path, row=line, column=column)
    if d > INT64_MAX:  # the records keep every count and id in an int64
        raise InputError(f"{value!r} is beyond {INT64_MAX:,}", path=path, row=line, column=column)
    return int(d)


def parse_hash_id(value: object, path: Path, line: int, column: str) -> int:
    """A prompt block's hash id: a whole number from 0 to INT64_MAX in plain digits (an id is a name, so 12.0 or
    1.2e1 is no spelling of it), or an InputError naming where it is. `value` is text, or what a JSON line held."""
    # isascii: str.isdigit also takes digits such as '\u00b2' that int() refuses; the length first, as int() refuses
    # text of over 4,300 digits with a ValueError
    if (isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= len(str(INT64_MAX))
            and int(value) <= INT64_MAX):
        return int(value)
    shown = repr(value) if isinstance(value, str) else json.dumps(value)
    raise InputError(f"hash id {shown} is not a whole number from 0 to {INT64_MAX:,}", path=path, row=line,
                     column=column)
