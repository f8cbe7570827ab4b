"""Where and how a result was made: versions, host, time, command line, git commit."""
from __future__ import annotations

import datetime as _dt
import importlib.metadata as md
import platform
import subprocess
import sys
from pathlib import Path

PACKAGES = ("numpy", "pandas", "scipy", "simpy", "torch", "triton", "transformers")


def versions(packages=PACKAGES) -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in packages:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def provenance() -> dict:
    return {"software": versions(), "host": platform.node(), "created_at": now_iso(), "git_commit": git_commit(),
            "argv": sys.argv}
