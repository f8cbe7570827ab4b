"""The arrival options of every command that draws a seeded trace at a rate: --burstiness and --ramp-up-s
(servecap/traces/workload.py's poisson_arrivals defines them); and the workload options of the commands that run one
trace, `sim run` and `engine run` (servecap/traces/trace_io.py requested_trace makes their trace)."""
from __future__ import annotations

import argparse
from pathlib import Path

from .arg_types import positive_arg, rate_arg, requests_arg, seconds_arg, seed_arg
from .prompts import PROMPT_NAMES
from .workload import DEFAULT_N, arrival_meta

BURSTINESS_HELP = ("gamma-distributed gaps between arrivals, of shape B and mean 1/rate, as vLLM's bench defines "
                   "--burstiness: 1 is Poisson (the default, the same trace as without the option), below 1 burstier, "
                   "above 1 more even")
RAMP_HELP = ("ramp the arrival rate up linearly from 0 at t=0 to the rate at t=S, steady after: the expected "
             "arrivals by time t are rate*t^2/(2S) up to S and rate*(t-S/2) after (the steady trace's arrivals moved "
             "in time to match; the same requests in the same order) (default 0: no ramp)")


def add_arrival_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--burstiness", type=positive_arg, default=1.0, metavar="B", help=BURSTINESS_HELP)
    p.add_argument("--ramp-up-s", type=seconds_arg, default=0.0, metavar="S", help=RAMP_HELP)


def add_workload_options(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """One run's workload: a trace file (at its own rate, or scaled in time to --rate), a seeded Poisson trace at
    --rate, or a closed run; the group, for a command's own workload options. --n and --seed default to None, so that
    a command can refuse them where they do nothing (requested_trace takes None for their defaults)."""
    g = p.add_argument_group("workload (--rate, --trace, or a closed run)")
    w = g.add_mutually_exclusive_group()
    w.add_argument("--trace", type=Path, metavar="FILE", help="a request-trace file (python -m traces ...); with "
                                                               "--rate, its time is scaled to that rate")
    w.add_argument("--closed-mixed", type=requests_arg, metavar="N", help="N requests of a mixed draw, all at t=0")
    w.add_argument("--closed-uniform", choices=PROMPT_NAMES, metavar="PROMPT",
                   help=f"--n copies of one prompt ({', '.join(PROMPT_NAMES)}), all at t=0")
    g.add_argument("--rate", type=rate_arg, help="arrival rate in requests/s: a seeded Poisson trace, or --trace's "
                                                 "time scaled to it")
    g.add_argument("--n", type=requests_arg, help=f"requests of --rate or --closed-uniform (default {DEFAULT_N})")
    g.add_argument("--seed", type=seed_arg, help="seed of --rate's arrival gaps and --closed-mixed's draw (default 0)")
    add_arrival_options(g)
    return g


def given(args: argparse.Namespace) -> dict:
    """The arrival options away from their defaults (as trace metadata names them): {} for a plain Poisson trace."""
    return arrival_meta(args.burstiness, args.ramp_up_s)
