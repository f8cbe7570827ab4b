"""The argument types the sim commands share (run, sweep and capacity): a decode backend, a router, workload seeds,
and comma-separated lists of any argument type."""
from __future__ import annotations

import argparse
from typing import Callable

from servecap.core.routing import ROUTERS
from servecap.costs.shapes import BACKENDS, backend_from_user
from servecap.traces.arg_types import checked, seed_arg
from servecap.traces.errors import InputError

MAX_SEEDS = 1000  # a guard against a typo (0-99999), not a limit of the method


def list_of(item: Callable[[str], object]) -> Callable[[str], list]:
    """An argument type for a comma-separated list of `item`s; an empty list is refused as `item` refuses ""."""
    return lambda text: [item(t.strip()) for t in text.split(",") if t.strip()] or item("")


backend_arg = checked(lambda v: backend_from_user(v, "sim"), lambda v: v in BACKENDS,
                      f"a backend ({', '.join(BACKENDS)})")
router_arg = checked(str, lambda v: v in ROUTERS, f"a router ({', '.join(ROUTERS)})")


def seeds_arg(text: str) -> list[int]:
    """Workload seeds: a range A-B (both included) or a list A,B,C."""
    first, dash, last = text.partition("-")
    if dash and first.strip() and last.strip():
        lo, hi = seed_arg(first.strip()), seed_arg(last.strip())
        if hi < lo:
            raise argparse.ArgumentTypeError(f"{text!r} is not a range of seeds A-B with A <= B")
        if hi - lo >= MAX_SEEDS:
            raise argparse.ArgumentTypeError(f"{text!r} is more than {MAX_SEEDS} seeds")
        return list(range(lo, hi + 1))
    return list(dict.fromkeys(list_of(seed_arg)(text)))


def refuse_unused(args: argparse.Namespace, unused: dict[str, str]) -> None:
    """Refuse options given where they do nothing, so no one believes they took effect."""
    for option, why in unused.items():
        if getattr(args, option.lstrip("-").replace("-", "_")) is not None:
            raise InputError(f"{option} does nothing {why}")
