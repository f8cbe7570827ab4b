"""What every command line of the project shares: a refusal is one line on stderr and exit status 2, whether
argparse or the command's own checks refuse; a warning is said once; and output to a reader that has gone (`| head`)
is dropped quietly while the command finishes its work."""
from __future__ import annotations

import argparse
import functools
import importlib
import os
import re
import sys
import warnings
from typing import Callable

from .errors import InputError


class Parser(argparse.ArgumentParser):
    """argparse's parser, refusing in one line: `PROG: error: WHAT (see --help)`, exit status 2.

    argparse prints the whole usage first (4 to 16 lines), which pushes the one line that matters out of sight;
    subcommands' parsers are of this class too (add_subparsers makes them of the parent's class)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class Warnings:
    """A command's warnings on stderr, `PROG: warning: ...`, each kind once: the same warning about other numbers
    (a cost table extrapolated at 6093 tokens, then at 6096) is one kind, which every point of a sweep and every cost
    draw of a band would otherwise say again. Callable as warnings.showwarning."""

    def __init__(self, prog: str):
        self.prog, self.said = prog, set()

    def __call__(self, message, *_, **__) -> None:
        kind = re.sub(r"\d[\d,.]*", "#", str(message))
        if kind not in self.said:
            self.said.add(kind)
            print(f"{self.prog}: warning: {message}", file=sys.stderr)


class _DropWhenClosed:
    """A text stream that, once its reader has gone (EPIPE), sends the rest of the output to /dev/null.

    A command piped into `head` must neither end in a BrokenPipeError traceback nor stop half-way: a sweep prints
    its table before it writes its files."""

    def __init__(self, stream):
        self._stream = stream
        self._gone = False

    def _closed(self) -> None:
        self._gone = True
        null = os.open(os.devnull, os.O_WRONLY)
        try:  # what the stream still buffers goes there too, also at interpreter exit
            os.dup2(null, self._stream.fileno())
        except (OSError, ValueError):  # a stream with no file descriptor (io.UnsupportedOperation is both)
            pass
        finally:
            os.close(null)

    def write(self, text: str) -> int:
        if not self._gone:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._closed()
        return len(text)

    def flush(self) -> None:
        if not self._gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._closed()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def command(prog: str) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """Wrap a command line's `main`: an InputError it raises is `PROG: error: ...` on stderr and exit status 2, as
    are a path that is not there or not readable, running out of memory (a size no up-front check foresaw) and a
    dependency not installed; a warning is `PROG: warning: ...`, each kind once (Warnings); stdout and stderr
    survive a reader that left."""
    def wrap(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def guarded(*args, **kwargs) -> int:
            streams = sys.stdout, sys.stderr
            sys.stdout, sys.stderr = _DropWhenClosed(sys.stdout), _DropWhenClosed(sys.stderr)
            try:
                with warnings.catch_warnings():
                    warnings.showwarning = Warnings(prog)
                    return main(*args, **kwargs)
            except InputError as e:
                print(f"{prog}: error: {e}", file=sys.stderr)
                return 2
            except ModuleNotFoundError as e:
                # A dependency missing from this environment (e.g. the simulator's simpy on a bare GPU image); one of
                # servecap's own modules missing is a bug, and keeps its traceback.
                if (e.name or "").partition(".")[0] == "servecap":
                    raise
                print(f"{prog}: error: {e.name or e} is not installed here; install the project (pip install -e .) "
                      f"or the package", file=sys.stderr)
                return 2
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError) as e:
                # A path given that is not there or not readable, found where the command first opens it.
                if e.filename is None:
                    raise
                print(f"{prog}: error: {e.filename}: {e.strerror}", file=sys.stderr)
                return 2
            except MemoryError:
                print(f"{prog}: error: ran out of memory; ask for a smaller run (fewer requests or smaller sizes)",
                      file=sys.stderr)
                return 2
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                sys.stdout, sys.stderr = streams
        return guarded
    return wrap


def entry(prog: str, module: str, argv: list[str] | None = None) -> int:
    """Run command-line `module`'s main as PROG with its import inside `command`'s guard too: a command line that
    imports numpy or tqdm at its top meets a missing package before its own guarded main runs."""
    @command(prog)
    def imported(argv: list[str] | None) -> int:
        return importlib.import_module(module).main(argv)
    return imported(argv)
