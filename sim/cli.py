"""`python -m sim`: simulate one point (run) or a grid of them (sweep); with no arguments, the default sweep.

Everything a command is given is checked before anything runs or is written; a problem is one line on
stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

from costs.shapes import BACKENDS
from engine.block_pool import DEFAULT_BLOCK_SIZE
from engine.scheduler import PrefillPolicy
from traces.cli import checked, count_arg, rate_arg, seed_arg
from traces.errors import InputError
from traces.prompts import PROMPT_NAMES
from traces.workload import DEFAULT_N, poisson_trace

from . import inputs
from .sweep import AUTO_POINTS, AUTO_SPAN, Config, Workload, run_sweep

# pandas (records, metrics), SimPy, tqdm and provenance's probes are imported by the commands that use them, so
# that --help and a refused argument answer without them (pandas alone takes longer to import than a
# 400-request point takes to simulate).

DEFAULT_OUT = Path("sim-out")
SUBCOMMANDS = ("run", "sweep")


def _list(item: Callable[[str], object]) -> Callable[[str], list]:
    return lambda text: [item(t.strip()) for t in text.split(",") if t.strip()] or item("")


_gib = checked(float, lambda v: math.isfinite(v) and v > 0, "a positive number of GiB")
_backend = checked(str, lambda v: v in BACKENDS, f"a backend ({', '.join(BACKENDS)})")


def _policy(text: str) -> str:
    try:
        return str(PrefillPolicy.parse(text))
    except InputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _rates(text: str) -> list[float] | None:
    return None if text.strip() == "auto" else _list(rate_arg)(text)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--table", type=Path, help="cost table JSON (default: the shipped H200 table, costs/data/h200.json)")
    p.add_argument("--allow-nonstationary", action="store_true",
                   help="use a table whose stationarity check failed (its step costs depended on what ran before)")
    p.add_argument("--block-size", type=count_arg, default=DEFAULT_BLOCK_SIZE,
                   help="KV block size in tokens; the table must have been measured with it (default %(default)s)")
    p.add_argument("--strict", action="store_true",
                   help="refuse shapes outside the table's measured range instead of extrapolating with a warning")
    p.add_argument("--noise-seed", type=seed_arg,
                   help="multiply step times by seeded log-normal noise with the table's spread (default: none)")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m sim", description=(
        "Predict an LLM server's capacity and queue waits by replaying request traces through the engine's own "
        "scheduler on simulated time, with step costs from a GPU cost table. With no command: the default sweep."))
    sub = top.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="simulate one point and print its summary", description=(
        "Simulate one trace at one configuration and print its summary; --out writes the full run record "
        "(the engine's schema). The trace: --rate (seeded Poisson), --trace FILE, --closed-mixed or --closed-uniform."))
    src = run.add_mutually_exclusive_group()
    src.add_argument("--trace", type=Path, help="a request-trace file; with --rate, its time is scaled to that rate")
    src.add_argument("--closed-mixed", type=count_arg, metavar="N", help="N mixed requests all arriving at t=0")
    src.add_argument("--closed-uniform", choices=PROMPT_NAMES, metavar="PROMPT",
                     help=f"--n copies of one prompt ({', '.join(PROMPT_NAMES)}) all arriving at t=0")
    run.add_argument("--rate", type=rate_arg, help="arrival rate in requests/s")
    run.add_argument("--n", type=count_arg, default=DEFAULT_N, help="requests in a generated trace (default %(default)s)")
    run.add_argument("--seed", type=seed_arg, default=0, help="workload seed (default %(default)s)")
    run.add_argument("--backend", type=_backend, default="paged",
                     help="decode backend: paged or padded (default paged)")
    run.add_argument("--max-batch", type=count_arg, default=32, help="batch rows (default %(default)s)")
    run.add_argument("--prefill", type=_policy, default="padded", metavar="POLICY",
                     help="prefill policy: padded (each group padded to its widest prompt), packed (true lengths) or "
                          "chunked:N (N prompt tokens a step between decode steps) (default padded)")
    pool = run.add_mutually_exclusive_group()
    pool.add_argument("--pool-gib", type=_gib, help="KV pool size in GiB")
    pool.add_argument("--pool-blocks", type=count_arg, help="KV pool size in blocks (default: enough that it never binds)")
    run.add_argument("--out", type=Path, help="write the run record here (per-step rows; per-token rows with --tokens)")
    run.add_argument("--tokens", action="store_true", help="with --out, also write every token's time")
    run.add_argument("--no-fast-forward", action="store_true",
                     help="step every decode step through the event loop (slower, identical results)")
    _common(run)
    run.set_defaults(func=cmd_run)

    sweep = sub.add_parser("sweep", help="simulate a grid of rates x pools x batch sizes x backends in parallel",
                           description=(
        "Simulate every configuration at every arrival rate on all local cores, print a table, a capacity bracket "
        "and the mechanism per configuration, and write sweep.csv, sweep.json and sweep.png."))
    sweep.add_argument("--rates", type=_rates, default=None, metavar="R1,R2,...|auto",
                       help=f"arrival rates in requests/s, or 'auto' (default): {AUTO_POINTS} rates from "
                            f"{AUTO_SPAN[0]}x to {AUTO_SPAN[1]}x each configuration's estimated capacity")
    sweep.add_argument("--pool-gib", type=_list(_gib), default=[0.5, 1, 2, 4], metavar="G1,G2,...",
                       help="KV pool sizes in GiB (default 0.5,1,2,4)")
    sweep.add_argument("--max-batch", type=_list(count_arg), default=[16, 32], metavar="B1,B2,...",
                       help="batch rows (default 16,32)")
    sweep.add_argument("--backend", type=_list(_backend), default=list(BACKENDS), metavar="paged,padded",
                       help="backends (default paged,padded)")
    sweep.add_argument("--prefill", type=_list(_policy), default=["padded"], metavar="P1,P2,...",
                       help="prefill policies: padded, packed, chunked:N (default padded)")
    sweep.add_argument("--trace", type=Path, help="a request-trace file, scaled in time to each rate "
                                                  "(default: the seeded Poisson trace --n, --seed)")
    sweep.add_argument("--n", type=count_arg, default=DEFAULT_N, help="requests per point (default %(default)s)")
    sweep.add_argument("--seed", type=seed_arg, default=0, help="workload seed (default %(default)s)")
    sweep.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default ./%(default)s)")
    sweep.add_argument("--jobs", type=count_arg, help="worker processes (default: every core)")
    _common(sweep)
    sweep.set_defaults(func=cmd_sweep)

    return top


def _check_out(out: Path | None) -> None:
    from traces.records import TABLES
    if out is not None and any((out / f"{t}.csv").exists() for t in TABLES):
        raise InputError("already holds a run record; choose a new output directory", path=out)


def _write_record(rec, out: Path, tokens: bool, scored: dict) -> None:
    from traces.provenance import provenance
    from traces.records import RunWriter
    # Written only once the run has succeeded, so a refused or failed run leaves nothing behind.
    tables = ("requests", "steps", "rejected") + (("tokens",) if tokens else ())
    writer = RunWriter(out, {**rec.meta, **provenance()}, tables)
    for t in tables:
        writer.add_many(t, getattr(rec, t).itertuples(index=False, name=None))
    writer.close(summary=scored)


def _fmt(v: float, spec: str = ".2f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def cmd_run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from costs.model import CostModel
    from traces.metrics import summary

    from .simulator import SimConfig, simulate
    table = inputs.load_table(args.table, args.block_size, args.allow_nonstationary)
    inputs.check_backend(table, args.backend)
    trace = inputs.make_trace(rate=args.rate, n=args.n, seed=args.seed, trace_file=args.trace,
                              closed_mixed_n=args.closed_mixed, closed_uniform_prompt=args.closed_uniform)
    pool_blocks, how = inputs.pool_size(trace, args.max_batch, table.block_size, args.pool_gib, args.pool_blocks)
    inputs.check_trace(trace, table, args.max_batch, pool_blocks, table.block_size)
    _check_out(args.out)
    cfg = SimConfig(args.backend, args.max_batch, pool_blocks,
                    detail=("tokens" if args.tokens else "steps") if args.out else "summary",
                    fast_forward=not args.no_fast_forward, noise_seed=args.noise_seed,
                    policy=PrefillPolicy.parse(args.prefill))
    with tqdm(total=len(trace), unit="req", desc="simulating", disable=len(trace) < 20_000) as bar:
        result = simulate(trace, CostModel(table, args.strict), cfg, on_finish=bar.update)
    rate = trace.meta.get("rate") or trace.offered_rate  # None for a closed run: no stability verdict
    s = summary(result.record, rate)
    if args.out:
        _write_record(result.record, args.out, args.tokens, s)
    kind = trace.meta.get("kind", "trace file" if args.trace else "trace")
    print(f"trace    {kind}, {len(trace)} requests" + (f", rate {rate:g}/s" if rate else "") +
          (f", seed {trace.meta['seed']}" if "seed" in trace.meta else "") + f" (trace {trace.trace_id})")
    print(f"engine   {args.backend}, {args.prefill} prefill, max batch {args.max_batch}, pool {pool_blocks} blocks "
          f"({how}); {table.summary()}")
    if rate:
        verdict = "stable" if s["stable"] else "NOT stable"
        print(f"served   {_fmt(s['served_rate'])} req/s against {_fmt(s['expected_rate'])} offered: {verdict} "
              f"(queue wait rose {_fmt(s['trend_rise_s'])} s over the run)")
    else:
        print(f"served   {s['n']} requests in {_fmt(s['wall_time_s'])} s ({_fmt(s['served_rate'])} req/s)")
    print(f"latency  queue wait p50 {_fmt(s['queue_wait_p50'], '.3f')} s, p95 {_fmt(s['queue_wait_p95'], '.3f')} s; "
          f"TTFT p50 {_fmt(s['ttft_p50'], '.3f')} s, p95 {_fmt(s['ttft_p95'], '.3f')} s; "
          f"TPOT p50 {_fmt(s['tpot_p50'], '.4f')} s")
    print(f"groups   admission group size p50/p95/max {_fmt(s['group_size_p50'], '.0f')}/"
          f"{_fmt(s['group_size_p95'], '.0f')}/{_fmt(s['group_size_max'], '.0f')}; padding waste p50/p95 "
          f"{_fmt(s['padding_waste_p50'])}/{_fmt(s['padding_waste_p95'])} padded positions per prompt token")
    waited = "no request waited" if math.isnan(s["rows_while_queued"]) else \
        f"{s['rows_while_queued']:.1f} while requests waited"
    print(f"rows     {_fmt(s['mean_running_rows'], '.1f')} of {args.max_batch} running on average, {waited}; the queue "
          f"head waited for KV blocks with rows free {_fmt(s['head_blocked_frac'], '.0%')} of step time")
    rejected = len(result.record.rejected)
    if rejected:
        print(f"rejected {rejected} requests the engine refuses (see rejected.csv)")
    print(f"sim      {result.events:,} events ({len(trace):,} requests + {result.steps:,} steps) in "
          f"{result.wall_s:.2f} s ({result.events / result.wall_s:,.0f} events/s)")
    if args.out:
        print(f"wrote    the run record to {args.out}/")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from traces.provenance import provenance

    from .report import report, write_files
    table = inputs.load_table(args.table, args.block_size, args.allow_nonstationary)
    for b in args.backend:
        inputs.check_backend(table, b)
    workload = Workload(args.n, args.seed, inputs.load_trace(args.trace) if args.trace else None)
    if workload.base is not None and workload.base.offered_rate is None:
        raise InputError("every request of this trace arrives at once, so it cannot be scaled to arrival rates; "
                         "simulate it with `sim run --trace`", path=args.trace)
    requests = workload.base or poisson_trace(1.0, args.n, args.seed)  # the same requests at every rate
    configs = list(dict.fromkeys(Config(b, m, g, p) for b in args.backend for p in args.prefill for m in args.max_batch
                                 for g in args.pool_gib))
    rates = None if args.rates is None else sorted(set(args.rates))
    for c in configs:
        pool_blocks = c.pool_blocks(table.block_size)
        try:
            inputs.check_trace(requests, table, c.max_batch, pool_blocks, table.block_size)
        except InputError as e:
            raise InputError(f"{c.label} ({pool_blocks} blocks): {e}") from None
    what = f"trace {args.trace} ({len(requests)} requests)" if args.trace else \
        f"the seeded Poisson trace, {args.n} requests, seed {args.seed}"
    print(f"sweep: {len(configs)} configuration{'s' * (len(configs) > 1)} on {what}; {table.summary()}")
    if args.rates is None:
        print(f"rates: auto. Each configuration's capacity is estimated from one saturated run (all its requests "
              f"queued at t=0); its {AUTO_POINTS} rates span {AUTO_SPAN[0]}x to {AUTO_SPAN[1]}x that estimate")
    t0 = time.perf_counter()
    results, warned = run_sweep(table, configs, rates, workload, strict=args.strict, noise_seed=args.noise_seed,
                                jobs=args.jobs)
    for w in warned:
        _warn(w)
    print(report(results))
    meta = {"table": {"id": table.table_id, "device": table.device_name, "gpu_uuid": table.gpu_uuid,
                      "path": str(args.table or inputs.SHIPPED_TABLE)},
            "workload": {"trace_file": str(args.trace), "trace_id": requests.trace_id} if args.trace else
            {"kind": "poisson", "n": args.n, "seed": args.seed},
            "rates": "auto" if rates is None else rates, "block_size": table.block_size,
            "noise_seed": args.noise_seed, "strict": args.strict, "warnings": warned,
            "command": shlex.join(["python", "-m", "sim", *args.argv]), **provenance()}
    files = write_files(args.out, results, meta)
    events = sum(r["sim_events"] for res in results for r in res.rows)
    print(f"\n{sum(len(res.rows) for res in results)} points, {events:,} events in {time.perf_counter() - t0:.1f} s; "
          f"wrote " + ", ".join(str(f) for f in files))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in (*SUBCOMMANDS, "-h", "--help"):
        argv = ["sweep", *argv]  # no command: the default sweep, with any options given
    args = parser().parse_args(argv)
    args.argv = argv
    with warnings.catch_warnings():
        warnings.showwarning = lambda message, *_, **__: _warn(message)
        try:
            return args.func(args)
        except InputError as e:
            print(f"sim: error: {e}", file=sys.stderr)
            return 2


def _warn(message) -> None:
    print(f"sim: warning: {message}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
