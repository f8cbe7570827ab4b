"""The arrival options of every command that draws a seeded trace at a rate: --burstiness and --ramp-up-s
(servecap/traces/workload.py's poisson_arrivals defines them)."""
from __future__ import annotations

import argparse

from .arg_types import positive_arg, seconds_arg
from .workload import arrival_meta

BURSTINESS_HELP = ("gamma-distributed gaps between arrivals, of shape B and mean 1/rate, as vLLM's bench defines "
                   "--burstiness: 1 is Poisson (the default, the same trace as without the option), below 1 burstier, "
                   "above 1 more even")
RAMP_HELP = ("ramp the arrival rate up linearly from 0 at t=0 to the rate at t=S, steady after: the expected "
             "arrivals by time t are rate*t^2/(2S) up to S and rate*(t-S/2) after (the steady trace's arrivals moved "
             "in time to match; the same requests in the same order) (default 0: no ramp)")


def add_arrival_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--burstiness", type=positive_arg, default=1.0, metavar="B", help=BURSTINESS_HELP)
    p.add_argument("--ramp-up-s", type=seconds_arg, default=0.0, metavar="S", help=RAMP_HELP)


def given(args: argparse.Namespace) -> dict:
    """The arrival options away from their defaults (as trace metadata names them): {} for a plain Poisson trace."""
    return arrival_meta(args.burstiness, args.ramp_up_s)
