"""`python -m sim`: simulate one point (run) or a grid of them (sweep); with no arguments, the default sweep; replay an
engine's run record at its own step times (replay).

Everything a command is given is checked before anything runs or is written; a problem is one line on
stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from servecap.core.block_pool import DEFAULT_BLOCK_SIZE
from servecap.traces.arg_types import count_arg, seed_arg
from servecap.traces.command import Parser, command
from servecap.traces.errors import InputError

# pandas (records, metrics), SimPy, tqdm, matplotlib and provenance's probes are imported by the commands that use
# them, so that --help and a refused argument answer without them (pandas alone takes longer to import than a
# 400-request point takes to simulate).

SUBCOMMANDS = ("run", "sweep", "capacity", "replay")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--table", type=Path, help="cost table JSON (default: the shipped H200 table, servecap/costs/data/h200.json)")
    p.add_argument("--allow-nonstationary", action="store_true",
                   help="use a table whose stationarity check failed (its step costs depended on what ran before)")
    p.add_argument("--block-size", type=count_arg, default=DEFAULT_BLOCK_SIZE,
                   help="KV block size in tokens; the table must have been measured with it (default %(default)s)")
    p.add_argument("--strict", action="store_true",
                   help="refuse shapes outside the table's measured range instead of extrapolating with a warning")
    p.add_argument("--noise-seed", type=seed_arg,
                   help="multiply step times by seeded log-normal noise with the table's spread (default: none)")


def parser() -> argparse.ArgumentParser:
    top = Parser(prog="python -m sim", description=(
        "Predict an LLM server's capacity and queue waits by replaying request traces through the engine's own "
        "scheduler on simulated time, with step costs from a GPU cost table. With no command: the default sweep."))
    sub = top.add_subparsers(dest="command", required=True)

    from .capacity_cli import add_parser as add_capacity
    from .run_cli import add_parser as add_run
    from .sweep_cli import add_parser as add_sweep
    add_run(sub, _common)
    add_sweep(sub, _common)
    add_capacity(sub, _common)

    rep = sub.add_parser("replay", help="replay an engine's run record at its own step times: is the scheduling the "
                                        "engine's?", description=(
        "Put an engine's run record through the simulator's scheduler and step loop again, each step taking the "
        "time the engine's took (servecap/sim/replay.py), with the configuration its meta.json names. Identical "
        "(exit 0): every step as the engine ran it and every request's admission, first token and finish within "
        "1 us; then what a prediction of the run misses is the step costs alone. Otherwise (exit 1) it names the "
        "first step that differs. A validation's runs: python -m validate replay."))
    rep.add_argument("run", type=Path, metavar="RUN_DIR", help="the engine's run-record directory (one engine)")
    rep.add_argument("--trace", type=Path, required=True, help="the request-trace file the run served")
    rep.set_defaults(func=cmd_replay)
    return top


def cmd_replay(args: argparse.Namespace) -> int:
    from servecap.traces.records import read_run, unfinished
    from servecap.traces.trace_io import read_trace

    from .replay import TIMES, replay
    rec = read_run(args.run)
    why = unfinished(rec)
    if why:
        raise InputError(why, path=args.run)
    r = replay(rec, read_trace(args.trace), args.run, args.trace)
    real, replayed = r.ttft_p50()
    errors = ", ".join(f"{c} {1e3 * r.error_s(c):.3f}" for c in TIMES)
    if r.identical:
        print(f"identical: {r.used} steps as the engine ran them; every request's times within 1 us "
              f"(largest |replayed - recorded| ms: {errors})")
        return 0
    d = r.divergence
    print("not identical: " + (f"step {d.index} at {d.start:.6f} s: the engine ran {d.recorded}, the scheduler "
                               f"asked for {d.asked}; " if d else "every step as the engine ran it, but ")
          + f"largest |replayed - recorded| ms: {errors}; TTFT p50 {1e3 * real:.1f} ms recorded, "
          f"{1e3 * replayed:.1f} ms replayed")
    return 1


@command("sim")
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and not argv[0].startswith("-") and argv[0] not in SUBCOMMANDS:
        print(f"sim: error: unknown command {argv[0]!r} (the commands: {', '.join(SUBCOMMANDS)}; with none, or "
              f"only options, the default sweep runs)", file=sys.stderr)
        return 2
    if not argv or argv[0] not in (*SUBCOMMANDS, "-h", "--help"):
        argv = ["sweep", *argv]  # no command: the default sweep, with any options given
    args = parser().parse_args(argv)
    args.argv = argv
    try:
        return args.func(args)
    except KeyboardInterrupt:  # before anything was written (a sweep says itself what it kept)
        print("\nsim: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
