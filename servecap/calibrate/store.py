"""The points file: every measured run of a calibration, one JSON line each, appended and flushed as it is made.

An interrupted calibration keeps what it measured and a re-run with the same --out skips it. The first line
names the engine and device the runs were made on; a resume anywhere else is refused, since its numbers would
not belong in the same table.
"""
from __future__ import annotations

from pathlib import Path

from servecap.traces.csvio import read_text
from servecap.traces.errors import InputError
from servecap.traces.jsonl_store import JsonLines, complete_lines, drop_cut_off, entries, header

SCHEMA = "calibration-points"
VERSION = 1


def points_path(table_path: str | Path) -> Path:
    return Path(f"{table_path}.points.jsonl")


class PointsFile:
    def __init__(self, path: str | Path, identity: dict | None):
        """identity None: read the runs whatever setup made them (a refit), never to add to them."""
        self.path = Path(path)
        self.identity = identity
        self.samples: dict[str, dict] = {}
        if not (self.path.exists() and self.path.stat().st_size and self._read()):
            # New, or only the header of a start that measured nothing: (re)start it with this setup.
            self._f = JsonLines.create(self.path, {"schema": SCHEMA, "version": VERSION, "identity": identity},
                                       separators=(",", ":"))
        else:
            self._f = JsonLines(self.path, separators=(",", ":"))

    def _read(self) -> bool:
        """Load the measured runs; False when the file holds none (nothing to resume, whatever its setup)."""
        text = read_text(self.path)  # not UTF-8 is refused with its line
        lines, cut_off = complete_lines(text)
        drop_cut_off(self.path, text, cut_off)  # killed mid-write: the next append starts a line of its own
        head = header(lines)
        if head is None or head.get("schema") != SCHEMA:
            raise InputError(f"is not a calibration points file (expected a {SCHEMA!r} first line)", path=self.path)
        if len(lines) == 1:
            return False
        if head.get("version") != VERSION:
            raise InputError(f"points-file version {head.get('version')!r} is not {VERSION}", path=self.path)
        theirs = head.get("identity", {})
        diff = [f"{k} {theirs.get(k)!r} (now {v!r})" for k, v in (self.identity or {}).items() if theirs.get(k) != v]
        if diff:
            raise InputError(f"holds points measured with another setup: {'; '.join(diff)}. Resume on the same "
                             f"setup, or choose another --out (or delete this file) to start over", path=self.path)
        self.samples = entries(lines, "key", "sample", path=self.path,
                               refusal="is not a measured run (corrupt points file?)")
        return True

    def __contains__(self, key: str) -> bool:
        return key in self.samples

    def add(self, key: str, sample: dict) -> None:
        self._f.write({"key": key, "sample": sample})
        self.samples[key] = sample

    def close(self) -> None:
        self._f.close()
