"""CSV files with a one-line JSON header naming their schema and version.

Every file this project writes starts with `# {"schema": ..., "version": ...}` so a reader can refuse
files it does not understand instead of misreading them.
"""
from __future__ import annotations

import contextlib
import csv
import gzip
import io
import json
import math
import os
from pathlib import Path
from typing import Iterable, Sequence

from .errors import InputError
from .outpath import write_error


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
    """Write a whole file so that a reader never sees half of it, and leave no temporary file if that fails."""
    path = Path(path)
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
    """Appends rows to a CSV and flushes each one, so a killed process keeps every completed row.

    Read such a file with read_table(..., appended=True), which drops a last row cut off mid-write.
    """

    def __init__(self, path: Path, schema: str, version: int, columns: Sequence[str]):
        self.path = Path(path)
        self.columns = list(columns)
        fresh = not self.path.exists() or self.path.stat().st_size == 0
        self._f = open(self.path, "a", newline="", encoding="utf-8")
        self._w = csv.writer(self._f, lineterminator="\n")
        if fresh:
            self._f.write(header_line(schema, version))
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


def read_table(path: Path, schema: str, versions: Sequence[int], columns: Sequence[str], *,
               appended: bool = False) -> tuple[dict, list[list[str]]]:
    """Header metadata and the data rows as strings; a malformed row is refused with its line.

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
    meta = parse_header(lines[0], path, schema, versions)
    reader = csv.reader(lines[1:], strict=True)  # reader.line_num + 1 is the file's line: the header is line 1
    try:
        header = next(reader, None)
        if header is None:
            raise InputError("no column header line", path=path, row=2)
        missing = [c for c in columns if c not in header]
        if missing:
            raise InputError(f"missing columns {missing}; found {header}", path=path, row=2)
        idx = [header.index(c) for c in columns]
        out = []
        for r in reader:
            if len(r) != len(header):
                raise InputError(f"has {len(r)} fields, the header has {len(header)}", path=path,
                                 row=reader.line_num + 1)
            out.append([r[j] for j in idx])
    except csv.Error as e:
        raise InputError(f"is not valid CSV ({e})", path=path, row=reader.line_num + 1) from None
    return meta, out


def parse_int(value: str, path: Path, line: int, column: str, minimum: int) -> int:
    """A whole number (written as 12 or 12.0) of at least `minimum`, or an InputError naming where it is."""
    try:
        f = float(value)
    except ValueError:
        raise InputError(f"{value!r} is not a number", path=path, row=line, column=column) from None
    if math.isnan(f) or not f.is_integer():
        raise InputError(f"{value!r} is not a whole number", path=path, row=line, column=column)
    if f < minimum:
        raise InputError(f"{value!r} must be at least {minimum}", path=path, row=line, column=column)
    return int(f)
