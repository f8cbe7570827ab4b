"""Where and how a result was made: versions, host, time, command line, git commit."""
from __future__ import annotations

import datetime as _dt
import importlib.metadata as md
import os
import platform
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

PACKAGES = ("numpy", "pandas", "scipy", "simpy", "torch", "triton", "transformers")


@lru_cache(maxsize=1)
def _versions(packages: tuple[str, ...]) -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in packages:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def versions(packages=PACKAGES) -> dict[str, str | None]:
    return dict(_versions(tuple(packages)))


@lru_cache(maxsize=1)
def git_commit() -> str | None:
    """The checkout's commit, with '-dirty' when tracked files differ from it; SERVECAP_GIT_COMMIT, where set, wins:
    a copy of the working tree sent to a lent GPU machine can carry a .git older than the tree."""
    if os.environ.get("SERVECAP_GIT_COMMIT"):
        return os.environ["SERVECAP_GIT_COMMIT"]
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                                cwd=here).stdout.strip()
        if commit:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                   text=True, timeout=5, cwd=here).stdout.strip()
            return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def provenance() -> dict:
    return {"software": versions(), "host": platform.node(), "created_at": now_iso(), "git_commit": git_commit(),
            "argv": sys.argv}


def gpu_matches(actual: str, expected: str) -> bool:
    """Exact device-name match, with or without the vendor prefix: an 'A10G' is not an 'A10'."""
    def norm(name: str) -> str:
        name = name.strip().lower()
        return name[len("nvidia "):] if name.startswith("nvidia ") else name
    return norm(actual) == norm(expected)
