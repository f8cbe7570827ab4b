"""The argument types every command shares: each refuses a value outside what its option means, in one line that
says what it needs (argparse turns it into the command's usage error, exit status 2). Light to import: `sim --help`
loads this, not the traces command."""
from __future__ import annotations

import argparse
import math
from typing import Callable

from .errors import InputError
from .slo import SLO, parse_slos


def checked(kind: type, ok: Callable[[float], bool], need: str) -> Callable[[str], float]:
    """An argparse type that refuses values outside what the option means, saying what it needs."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {need}")
        return value
    return parse


def slo_arg(text: str) -> tuple[SLO, ...]:
    """SLOs as servecap/traces/slo.py writes them, refused with what is wrong."""
    try:
        return parse_slos(text)
    except InputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


SLO_HELP = ("service-level objectives, NAME[_pNN]=SECONDS,... or vLLM's NAME[_pNN]:MILLISECONDS,...: NAME ttft, tpot "
            "or e2el (e2e), each a per-request limit that goodput counts; a _pNN suffix also holds that percentile to "
            "the limit (e.g. ttft_p99=2,tpot_p99=0.05 or ttft:500,tpot:50); a value may name its unit under either "
            "sign (ttft_p99=500ms); reports print limits in ms")
rate_arg = checked(float, lambda v: math.isfinite(v) and v > 0, "a positive number of requests per second")
count_arg = checked(int, lambda v: v >= 1, "a whole number >= 1")
seed_arg = checked(int, lambda v: v >= 0, "a whole number >= 0")
level_arg = checked(float, lambda v: 0 < v < 100, "a percentage between 0 and 100 (an interval's level)")
tokens_arg = checked(int, lambda v: v >= 0, "a whole number of tokens >= 0")
mean_arg = checked(float, lambda v: math.isfinite(v) and v >= 1, "a mean of at least 1")
seconds_arg = checked(float, lambda v: math.isfinite(v) and v >= 0, "a number of seconds >= 0")
positive_arg = checked(float, lambda v: math.isfinite(v) and v > 0, "a positive number")

# Sizes past which a run would not fit in memory or its counts would not be exact; each is far above real use.
MAX_REQUESTS = 10_000_000  # the simulator holds about 1.5 KB a request: 10 million is ~15 GB
MAX_BATCH = 1_000_000  # batch rows: the engine captures a graph per row count, the simulator keeps a row each
MAX_POOL_BLOCKS = 2 ** 50  # block counts stay exact in a float64 (2**53) through every sum of them
MAX_POOL_GIB = 2.0 ** 40  # an exbibyte in GiB: about 6e14 blocks of 64 Qwen2.5-1.5B tokens, below MAX_POOL_BLOCKS
requests_arg = checked(int, lambda v: 1 <= v <= MAX_REQUESTS, f"a whole number of requests from 1 to {MAX_REQUESTS:,}")
batch_arg = checked(int, lambda v: 1 <= v <= MAX_BATCH, f"a whole number of batch rows from 1 to {MAX_BATCH:,}")
gib_arg = checked(float, lambda v: math.isfinite(v) and 0 < v <= MAX_POOL_GIB,
                  f"a positive number of GiB up to {MAX_POOL_GIB:.4g}")
blocks_arg = checked(int, lambda v: 1 <= v <= MAX_POOL_BLOCKS, f"a whole number of blocks from 1 to {MAX_POOL_BLOCKS:,}")
