"""The mechanics of a resumable JSON-lines store: a header line naming what the file holds, then one entry a line,
each flushed as it is written so that a killed process loses no finished entry.

Each store (servecap/calibrate/store.py, servecap/sim/store.py) keeps its own header check and messages; this module only splits,
parses and appends lines.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import InputError


def complete_lines(text: str) -> tuple[list[str], str]:
    """The whole lines of an appended file, and what follows the last newline: a line cut off mid-write (or "")."""
    lines = text.split("\n")
    return lines[:-1], lines[-1]


def drop_cut_off(path: Path, text: str, cut_off: str) -> None:
    """Truncate the file to its whole lines, so that the next append starts a line of its own (in place: the
    whole lines are never rewritten, so a kill here loses nothing finished)."""
    if cut_off:
        os.truncate(path, len(text.encode("utf-8")) - len(cut_off.encode("utf-8")))


def header(lines: list[str]) -> dict | None:
    """The first line as a JSON object; None when there is none or it is not one."""
    try:
        head = json.loads(lines[0]) if lines else None
    except json.JSONDecodeError:
        return None
    return head if isinstance(head, dict) else None


def entries(lines: list[str], key: str, value: str, *, path: Path, refusal: str) -> dict:
    """entry[key] -> entry[value] for each line after the header; a line that is not such an entry is refused
    with `refusal` and its line number."""
    found = {}
    for row, line in enumerate(lines[1:], start=2):
        try:
            entry = json.loads(line)
            found[entry[key]] = entry[value]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise InputError(refusal, path=path, row=row) from None
    return found


class JsonLines:
    """A JSON-lines file opened for appending; every line is flushed as it is written."""

    def __init__(self, path: Path, **json_options):
        """json_options go to json.dumps for every line written (the file's own format)."""
        self._f = open(path, "a", encoding="utf-8")
        self._options = json_options

    @classmethod
    def create(cls, path: Path, head: dict, **json_options) -> JsonLines:
        """Start the file anew with its header line (written with sort_keys), replacing any file there."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(head, sort_keys=True, allow_nan=True) + "\n", encoding="utf-8")
        return cls(path, **json_options)

    def write(self, obj: dict) -> None:
        self._f.write(json.dumps(obj, **self._options) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()
