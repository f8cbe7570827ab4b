"""A sweep's points file: every finished point (and capacity estimate) appended and flushed as it comes back, so an
interrupted sweep keeps its work and `--resume` runs only what is missing.

The file is JSON lines. The first names the sweep's setup (table, workload, configurations, rates, seeds, noise,
strictness): a resume must be the same sweep, or its points would be mixed with another's. Each further line is
one result under its key. A last line cut off by a kill is dropped on reading.
"""
from __future__ import annotations

import json
from pathlib import Path

from servecap.traces.csvio import read_text
from servecap.traces.errors import InputError
from servecap.traces.jsonl_store import JsonLines, complete_lines, drop_cut_off, entries, header

SCHEMA = "sim-sweep-points"
VERSION = 1
FILE = "sweep.points.jsonl"


def key_text(key: tuple) -> str:
    """A key as text: the same key always gives the same text (floats written exactly)."""
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


class PointStore:
    """Results by key, kept in `path` (None: in memory only). A new store starts the file; resume=True reads the
    one there. Every value is kept as it reads back from JSON, so a resumed sweep sees exactly what a whole one does."""

    def __init__(self, path: str | Path | None, setup: dict, *, resume: bool = False):
        self.path = Path(path) if path is not None else None
        self.setup = setup
        self.done: dict[str, object] = {}
        self._f = None
        if self.path is None:
            return
        if resume:
            self._read()
            self._f = JsonLines(self.path, sort_keys=True, allow_nan=True)
        else:
            self._f = JsonLines.create(self.path, {"schema": SCHEMA, "version": VERSION, "setup": setup},
                                       sort_keys=True, allow_nan=True)

    def _read(self) -> None:
        if not self.path.exists():
            raise InputError("no interrupted sweep to resume here (no points file); run without --resume",
                             path=self.path)
        text = read_text(self.path)
        complete, cut_off = complete_lines(text)
        head = header(complete)
        if head is None or head.get("schema") != SCHEMA or head.get("version") != VERSION:
            raise InputError(f"is not a {SCHEMA} v{VERSION} file", path=self.path, row=1)
        if head.get("setup") != json.loads(json.dumps(self.setup)):
            differs = sorted(k for k in set(head["setup"]) | set(self.setup)
                             if head["setup"].get(k) != json.loads(json.dumps(self.setup.get(k))))
            raise InputError(f"was written by another sweep (its {', '.join(differs)} differ from this command's); "
                             f"resume with the same options, or pass --force to start over", path=self.path, row=1)
        self.done = entries(complete, "key", "value", path=self.path,
                            refusal="is not a sweep point (the file was edited?)")
        drop_cut_off(self.path, text, cut_off)  # so that the points this resume appends start on a line of their own

    def __contains__(self, key: tuple) -> bool:
        return key_text(key) in self.done

    def get(self, key: tuple):
        return self.done[key_text(key)]

    def add(self, key: tuple, value) -> None:
        text = key_text(key)
        self.done[text] = json.loads(json.dumps(value))
        if self._f is not None:
            self._f.write({"key": text, "value": value})

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
