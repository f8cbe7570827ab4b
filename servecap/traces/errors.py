"""One error type for bad input, always naming where the problem is."""
from __future__ import annotations


class InputError(ValueError):
    """Bad input: a malformed file, an impossible request, a mismatched cost table.

    The message names the file, row and column when there is one, so a user can fix it.
    """

    def __init__(self, message: str, *, path: object = None, row: int | None = None, column: str | None = None):
        where = []
        if path is not None:
            where.append(str(path))
        if row is not None:
            where.append(f"line {row}")
        if column is not None:
            where.append(f"column {column!r}")
        self.path, self.row, self.column = path, row, column
        super().__init__(f"{': '.join([', '.join(where), message]) if where else message}")


class WriteError(InputError, OSError):
    """An output that cannot be written (a read-only filesystem, a full disk), named by the path the user gave, not
    a temporary file beside it: a one-line refusal for a command, and still an OSError to the code that writes."""
