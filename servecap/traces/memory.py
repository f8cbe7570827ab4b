"""How much memory this process can still take, so that a run too large for it is refused before it starts rather
than ending in a MemoryError minutes later."""
from __future__ import annotations

import resource
from pathlib import Path

from .errors import InputError

GIB = 2 ** 30


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_available() -> int | None:
    """A container's memory limit less its use (cgroup v2), or None without one."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return None


def _address_space_available() -> int | None:
    """`ulimit -v` less what this process has mapped already, or None without a limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return soft - int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return soft


def available_bytes() -> int | None:
    """The least of the machine's available memory, the container's and the address-space limit; None when none of
    them can be read (not Linux)."""
    known = [b for b in (_meminfo_available(), _cgroup_available(), _address_space_available()) if b is not None]
    return max(0, min(known)) if known else None


def check_fits(need_bytes: float, what: str, smaller: str) -> None:
    """Refuse `what` when it needs more memory than this process can take, saying how much and what to shrink."""
    have = available_bytes()
    if have is not None and need_bytes > have:
        raise InputError(f"{what} needs about {need_bytes / GIB:,.1f} GiB of memory and this process can take "
                         f"{have / GIB:,.1f} GiB; {smaller}")
