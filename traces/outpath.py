"""Checks on where a command will write, made before it computes anything: a later failure to write would throw
away the work, and a traceback names no option. Every command that writes checks each of its outputs here."""
from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from .errors import InputError, WriteError

# errno's reasons in words a user can act on, for the path the user gave (never a temporary file beside it).
_REASONS = {errno.EACCES: "permission denied", errno.EPERM: "permission denied",
            errno.EROFS: "it is on a read-only filesystem", errno.ENOSPC: "the disk is full",
            errno.EDQUOT: "the disk quota is used up", errno.ENOTDIR: "a part of the path is a file, not a directory",
            errno.EEXIST: "a file is in the way of a directory", errno.EISDIR: "it is a directory",
            errno.ENAMETOOLONG: "the name is too long",
            errno.ENOENT: "no such directory"}


def reason(e: OSError) -> str:
    """Why an operating-system call failed, in words."""
    return _REASONS.get(e.errno, (e.strerror or str(e)).lower())


def write_error(path: str | Path, e: OSError) -> WriteError:
    """A failure to write `path` (the file the user named, never a temporary one beside it), in words."""
    return WriteError(f"cannot be written: {reason(e)}", path=path)


def _existing_ancestor(path: Path) -> Path:
    """The nearest part of `path` (itself or a parent) that exists; the current directory for a bare relative name."""
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _check_creatable(path: Path, directory: Path) -> None:
    """`directory` (not there yet, or a directory) can be made and written into, so `path` can be written: its
    nearest existing part is a writable directory. access(2) also answers for root, whom permissions do not stop
    but a read-only filesystem does."""
    base = _existing_ancestor(directory)
    if not base.is_dir():
        raise InputError(f"cannot be written: {base} is a file, not a directory", path=path)
    if not os.access(base, os.W_OK | os.X_OK):
        raise InputError(f"cannot be written: {base} is not writable (permissions, or a read-only filesystem)",
                         path=path)
    try:  # access(2) answers yes for root in /proc, where nothing can be made: try it
        fd, probe = tempfile.mkstemp(dir=base, prefix=".write-check-")
    except OSError as e:  # ENOENT in a directory that exists: a filesystem that makes no files
        why = "its filesystem takes no new files" if e.errno == errno.ENOENT else reason(e)
        raise InputError(f"cannot be written: no file can be made in {base}: {why}", path=path) from None
    os.close(fd)
    os.unlink(probe)


def check_out_dir(path: str | Path) -> Path:
    """An output directory: absent (it will be made) or a directory, and writable."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise InputError("is a file; the output must be a directory", path=path)
    _check_creatable(path, path)
    return path


def check_out_file(path: str | Path) -> Path:
    """An output file: not a directory, in a directory that exists or can be made, and writable."""
    path = Path(path)
    if path.is_dir():
        raise InputError("is a directory; the output must be a file", path=path)
    if path.exists() and not os.access(path, os.W_OK):
        raise InputError("is not writable", path=path)
    _check_creatable(path, path.parent)
    return path
