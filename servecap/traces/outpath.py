"""Checks on where a command will write, made before it computes anything: a later failure to write would throw
away the work, and a traceback names no option. Every command that writes checks each of its outputs here."""
from __future__ import annotations

import errno
import fcntl
import os
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

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


def refuse_special(path: str | Path) -> None:
    """Refuse to replace anything but a regular file: a rename over a symlink, a device node or a FIFO would put a
    regular file in its place (as root, /dev/null itself), which --force never means."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):  # a rename onto a directory fails by itself
        kind = "a symlink" if stat.S_ISLNK(mode) else "not a regular file"
        raise InputError(f"is {kind}; only a regular file is ever replaced: write to another path", path=path)


def same_file(a: Path, b: Path) -> bool:
    """The same file by any name: a symlink, a hard link, ./x or ../d/x."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return a.resolve() == b.resolve()


def _inside(path: Path, other: Path) -> bool:
    """`path` is the file `other`, or lies inside the directory `other` (there or still to be made)."""
    if other.exists() and not other.is_dir():
        return same_file(path, other)
    return path.resolve().is_relative_to(other.resolve())


def check_new_file(path: str | Path, *, force: bool, keep: dict[str, str | Path | None] | None = None,
                   option: str = "--out") -> Path:
    """An output file that replaces nothing it should not, checked before any work: never one of the command's own
    inputs or outputs, nor a file inside one of their directories (`keep`: what each is, e.g. {"the input trace
    (--trace)": path}); never anything but a regular file; and an existing file only with --force."""
    path = check_out_file(path)
    for what, other in (keep or {}).items():
        if other is not None and _inside(path, Path(other)):
            raise InputError(f"{option} would write over {what}; choose another file", path=path)
    refuse_special(path)
    if path.exists() and not force:
        raise InputError(f"already exists; pass --force to overwrite it ({option})", path=path)
    return path


def check_trace_events(path: str | Path | None, force: bool, keep: dict[str, str | Path | None]) -> None:
    """A run's --trace-events FILE (None: not asked for), as check_new_file; --force alone would do nothing."""
    if path is None:
        if force:
            raise InputError("--force does nothing without --trace-events (the only file it lets a run replace)")
        return
    check_new_file(path, force=force, keep=keep, option="--trace-events")


@contextmanager
def exclusive(directory: str | Path, what: str) -> Iterator[None]:
    """Hold `directory` for one command while it writes there: a second one (a --force or --resume while the first
    still runs) is refused instead of writing into the same files at its own offsets. The lock is flock(2) on a
    file kept in the directory, so a killed holder releases it with its last descriptor."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    f = open(directory / f".{what}.lock", "a")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise InputError(f"is in use by another {what} that is still running; wait for it to finish, or choose "
                         f"another --out", path=directory) from None
    try:
        yield
    finally:
        f.close()
