"""`python -m sim`: simulate one point (run) or a grid of them (sweep); with no arguments, the default sweep; replay an
engine's run record at its own step times (replay).

Everything a command is given is checked before anything runs or is written; a problem is one line on
stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import time
import warnings
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Iterator

from servecap.core.block_pool import DEFAULT_BLOCK_SIZE, PoolSize
from servecap.core.config import ServingConfig
from servecap.core.options import PREFILL_HELP, add_scheduler_options, policy_arg as _policy
from servecap.core.routing import ROUTERS
from servecap.costs.shapes import BACKENDS
from servecap.traces.arrival_options import add_arrival_options, given
from servecap.traces.arg_types import (SLO_HELP, batch_arg, blocks_arg, count_arg, gib_arg, level_arg, rate_arg,
                                       requests_arg, seed_arg, slo_arg)
from servecap.traces.command import Parser, command
from servecap.traces.errors import InputError
from servecap.traces.formatting import fmt_value
from servecap.traces.latency import DEFAULT_PERCENTILES, PERCENTILES_HELP, percentiles_arg
from servecap.traces.outpath import check_out_dir, check_trace_events, exclusive
from servecap.traces.prompts import PROMPT_NAMES
from servecap.traces.workload import DEFAULT_N

from . import inputs
from .arg_types import backend_arg, list_of, router_arg, seeds_arg
from .store import FILE, PointStore
from .sweep import AUTO_POINTS, AUTO_SPAN, RemoteMap, Workload, run_sweep

# pandas (records, metrics), SimPy, tqdm, matplotlib and provenance's probes are imported by the commands that use
# them, so that --help and a refused argument answer without them (pandas alone takes longer to import than a
# 400-request point takes to simulate).

DEFAULT_OUT = Path("sim-out")
SUBCOMMANDS = ("run", "sweep", "capacity", "replay")


def _rates(text: str) -> list[float] | None:
    return None if text.strip() == "auto" else list_of(rate_arg)(text)


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

    run = sub.add_parser("run", help="simulate one point and print its summary", description=(
        "Simulate one trace at one configuration and print its summary; --out writes the full run record "
        "(the engine's schema). The trace: --rate (seeded Poisson), --trace FILE, --closed-mixed or --closed-uniform."))
    src = run.add_mutually_exclusive_group()
    src.add_argument("--trace", type=Path, help="a request-trace file; with --rate, its time is scaled to that rate")
    src.add_argument("--closed-mixed", type=requests_arg, metavar="N", help="N mixed requests all arriving at t=0")
    src.add_argument("--closed-uniform", choices=PROMPT_NAMES, metavar="PROMPT",
                     help=f"--n copies of one prompt ({', '.join(PROMPT_NAMES)}) all arriving at t=0")
    run.add_argument("--rate", type=rate_arg, help="arrival rate in requests/s")
    run.add_argument("--n", type=requests_arg, help=f"requests of --rate or --closed-uniform (default {DEFAULT_N})")
    run.add_argument("--seed", type=seed_arg, help="seed of --rate's trace or --closed-mixed's draw (default 0)")
    add_arrival_options(run)
    run.add_argument("--backend", type=backend_arg, default="paged",
                     help="decode backend: paged or dense (every row read at the widest; old name padded) (default paged)")
    run.add_argument("--max-batch", type=batch_arg, default=32, help="batch rows (default %(default)s)")
    run.add_argument("--prefill", type=_policy, default="padded", metavar="POLICY",
                     help=PREFILL_HELP + " (default padded)")
    add_scheduler_options(run)
    pool = run.add_mutually_exclusive_group()
    pool.add_argument("--pool-gib", type=gib_arg, help="KV pool size in GiB")
    pool.add_argument("--pool-blocks", type=blocks_arg, help="KV pool size in blocks (default: enough that it never binds)")
    run.add_argument("--replicas", type=count_arg, default=1,
                     help="engines of this configuration behind a router, each with its own rows and pool (default 1)")
    run.add_argument("--router", type=router_arg,
                     help=f"with --replicas: how the router picks a replica: {', '.join(ROUTERS)} (default round-robin)")
    run.add_argument("--slo", type=slo_arg, default=(), metavar="SPEC", help=SLO_HELP)
    run.add_argument("--interval", type=level_arg, metavar="LEVEL",
                     help="also a LEVEL%% band for every metric: trace seeds x the cost model's uncertainty, widened "
                          "by the engine's measured run-to-run noise (servecap/sim/intervals.py)")
    run.add_argument("--jobs", type=count_arg, help="with --interval: processes for its runs (default: every core)")
    run.add_argument("--out", type=Path, help="write the run record here (per-step rows; per-token rows with --tokens)")
    run.add_argument("--tokens", action="store_true", default=None, help="with --out, also write every token's time")
    run.add_argument("--percentiles", type=percentiles_arg, default=DEFAULT_PERCENTILES, metavar="P1,P2,...",
                     help=PERCENTILES_HELP)
    run.add_argument("--save-result", type=Path, metavar="FILE.json",
                     help="also write the run's figures as one flat JSON object under vllm bench serve's keys "
                          "(request_throughput, p99_ttft_ms, mean_itl_ms, ...; servecap/traces/bench_result.py), with the "
                          "table, seed, trace and git commit; keeps every token's time in memory for ITL")
    run.add_argument("--trace-events", type=Path, metavar="FILE",
                     help="also write the run as Chrome trace-event JSON for ui.perfetto.dev")
    run.add_argument("--force", action="store_true", help="replace an existing --trace-events FILE")
    run.add_argument("--no-fast-forward", action="store_true",
                     help="step every decode step through the event loop (slower, identical results)")
    _common(run)
    run.set_defaults(func=cmd_run)

    sweep = sub.add_parser("sweep", help="simulate a grid of rates x pools x batch sizes x backends x fleets in "
                                         "parallel", description=(
        "Simulate every configuration at every arrival rate on all local cores (or on Modal: --on modal), keeping "
        "each point in --out as it finishes (--resume completes an interrupted sweep); print a table, a capacity "
        "bracket and the mechanism per configuration, and write sweep.csv, sweep.json and sweep.png (the same bytes "
        "each time), with sweep.run.json: when, where and how fast it ran."))
    sweep.add_argument("--rates", type=_rates, default=None, metavar="R1,R2,...|auto",
                       help=f"arrival rates in requests/s, or 'auto' (default): {AUTO_POINTS} rates from "
                            f"{AUTO_SPAN[0]}x to {AUTO_SPAN[1]}x each configuration's estimated capacity")
    sweep.add_argument("--pool-gib", type=list_of(gib_arg), default=[0.5, 1, 2, 4], metavar="G1,G2,...",
                       help="KV pool sizes in GiB (default 0.5,1,2,4)")
    sweep.add_argument("--max-batch", type=list_of(batch_arg), default=[16, 32], metavar="B1,B2,...",
                       help="batch rows (default 16,32)")
    sweep.add_argument("--backend", type=list_of(backend_arg), default=list(BACKENDS), metavar="paged,dense",
                       help="decode backends (default paged,dense; padded is the old name of dense)")
    sweep.add_argument("--prefill", type=list_of(_policy), default=["padded"], metavar="P1,P2,...",
                       help="prefill policies: padded, packed, chunked:N, mixed:N (default padded)")
    add_scheduler_options(sweep, many=list_of)
    sweep.add_argument("--replicas", type=list_of(count_arg), default=[1], metavar="N1,N2,...",
                       help="fleet sizes: engines behind a router (default 1); with more than one, the sweep also "
                            "says the fewest replicas that hold each rate")
    sweep.add_argument("--router", type=list_of(router_arg), metavar="R1,R2,...",
                       help=f"with --replicas above 1: routers, {', '.join(ROUTERS)} (default round-robin)")
    sweep.add_argument("--slo", type=slo_arg, default=(), metavar="SPEC",
                       help=SLO_HELP + "; capacity is then defined by the SLOs")
    sweep.add_argument("--on", choices=("local", "modal"), default="local",
                       help="where the points run: local worker processes (default) or Modal containers "
                            "(servecap/sim/modal_app.py; needs the modal package and a Modal token); either way each point "
                            f"is kept in --out's {FILE} as it comes back")
    sweep.add_argument("--trace", type=Path, help="a request-trace file, scaled in time to each rate "
                                                  "(default: the seeded Poisson trace --n, --seed)")
    sweep.add_argument("--n", type=requests_arg, help=f"requests per point (default {DEFAULT_N})")
    add_arrival_options(sweep)
    sweep.add_argument("--percentiles", type=percentiles_arg, default=DEFAULT_PERCENTILES, metavar="P1,P2,...",
                       help=PERCENTILES_HELP + "; the table shows the lowest and highest, sweep.csv every one")
    seeds = sweep.add_mutually_exclusive_group()
    seeds.add_argument("--seed", type=seed_arg, help="workload seed (default 0)")
    seeds.add_argument("--seeds", type=seeds_arg, metavar="A-B|S1,S2,...",
                       help="run every point on each of these workload seeds (e.g. 0-9) and report each number as a "
                            "band across them (mean, sd, min, max), with sweep.bands.csv beside sweep.csv")
    sweep.add_argument("--out", type=Path, default=DEFAULT_OUT,
                       help=f"output directory (default ./%(default)s); points are kept in it, in {FILE}, as they finish")
    again = sweep.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true",
                       help="complete the interrupted sweep in --out (the same command with --resume; --on may "
                            "differ): only the points it lacks run")
    again.add_argument("--force", action="store_true", help="replace the sweep already in --out")
    sweep.add_argument("--jobs", type=count_arg, help="local worker processes (default: every core)")
    sweep.add_argument("--interval", type=level_arg, metavar="LEVEL",
                       help="also write sweep.intervals.csv: a LEVEL%% band for every point's metrics (servecap/sim/intervals.py;"
                            " seeds x 8 cost factors per point, so slower)")
    _common(sweep)
    sweep.set_defaults(func=cmd_sweep)

    from .capacity_cli import add_parser as add_capacity
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


def _check_out(out: Path | None) -> None:
    from servecap.traces.records import TABLES
    if out is None:
        return
    check_out_dir(out)
    if any((out / f"{t}.csv").exists() for t in TABLES):
        raise InputError("already holds a run record; choose a new output directory", path=out)


SWEEP_FILES = ("sweep.csv", "sweep.json", "sweep.png", "sweep.bands.csv", "sweep.intervals.csv", "sweep.run.json",
               FILE)


def _check_sweep_out(args: argparse.Namespace) -> None:
    """A sweep writes into a new directory, completes its own interrupted sweep (--resume) or replaces one
    (--force); anything else would mix or lose results."""
    check_out_dir(args.out)
    there = [f for f in SWEEP_FILES if (args.out / f).exists()]
    if there and not (args.resume or args.force):
        hint = "pass --resume to complete it, " if FILE in there and "sweep.csv" not in there else ""
        raise InputError(f"already holds a sweep ({', '.join(there)}); {hint}pass --force to replace it, "
                         f"or choose another --out", path=args.out)
    if args.resume and FILE not in there:
        raise InputError(f"has no interrupted sweep to resume (no {FILE}); run without --resume", path=args.out)


def _refuse_unused(args: argparse.Namespace, unused: dict[str, str]) -> None:
    """Refuse options given where they do nothing, so no one believes they took effect."""
    for option, why in unused.items():
        if getattr(args, option.lstrip("-").replace("-", "_")) is not None:
            raise InputError(f"{option} does nothing {why}")


def _write_record(rec, out: Path, tokens: bool, scored: dict, imported: dict) -> None:
    from servecap.traces.provenance import provenance
    from servecap.traces.records import RunWriter
    # Written only once the run has succeeded, so a refused or failed run leaves nothing behind.
    tables = ("requests", "steps", "rejected") + (("tokens",) if tokens else ())
    writer = RunWriter(out, {**rec.meta, **imported, **provenance()}, tables)
    for t in tables:
        writer.add_many(t, getattr(rec, t).itertuples(index=False, name=None))
    writer.close(summary=scored)


def run_interval(args: argparse.Namespace, table, cfg, trace, rate) -> list[str]:
    """`sim run --interval`: the point's bands (a trace file or a closed uniform run is one trace sample)."""
    from . import intervals
    iv = intervals.Intervals(table, args.interval)
    if args.trace is None and args.closed_uniform is None:
        traces = intervals.seeded(lambda seed: inputs.make_trace(rate=args.rate, n=args.n, seed=seed,
                                                                 closed_mixed_n=args.closed_mixed), args.seed)
    else:
        traces = [trace]
    bands = iv.band(traces, intervals.simulated(cfg, rate), progress=True, jobs=args.jobs or os.cpu_count() or 1)
    return intervals.lines(bands, iv, len(traces))


def cmd_run(args: argparse.Namespace) -> int:
    if args.trace is not None:
        _refuse_unused(args, {"--n": "with --trace: the trace file holds the requests",
                              "--seed": "with --trace: the trace file holds the requests"})
    elif args.closed_mixed is not None:
        _refuse_unused(args, {"--n": "with --closed-mixed N: N is the number of requests"})
    elif args.closed_uniform is not None:
        _refuse_unused(args, {"--seed": "with --closed-uniform: every request is the same prompt"})
    if args.out is None:
        _refuse_unused(args, {"--tokens": "without --out: the token rows are written into the run record"})
    if args.interval is None:
        _refuse_unused(args, {"--jobs": "without --interval: a run is one process"})
    if args.replicas == 1:
        _refuse_unused(args, {"--router": "with one replica: there is nothing to route between (--replicas N)"})
    args.router = args.router or "round-robin"
    args.n = DEFAULT_N if args.n is None else args.n
    args.seed = 0 if args.seed is None else args.seed
    _check_out(args.out)  # every output, before any work
    check_trace_events(args.trace_events, args.force, {"the input trace (--trace)": args.trace,
                                                       "the cost table (--table)": args.table,
                                                       "the run record (--out)": args.out})
    if args.save_result:
        from servecap.traces.bench_result import check_result_path
        check_result_path(args.save_result)
    detail = "tokens" if args.save_result or (args.tokens and args.out) else \
        "steps" if args.out or args.trace_events else "summary"
    if args.trace is None:  # before making the requests: a trace of millions takes minutes and gigabytes itself
        inputs.check_memory(args.closed_mixed or args.n, detail)
    from tqdm import tqdm

    from servecap.costs.model import CostModel
    from servecap.traces.latency import latency_ms, latency_table
    from servecap.traces.metrics import per_replica, stability_said, summary
    from servecap.traces.slo import slo_line

    from .fleet_report import replica_table
    from .simulator import SimConfig, simulate
    serving = ServingConfig(block_size=args.block_size, max_batch=args.max_batch,
                            pool=PoolSize(args.pool_gib, args.pool_blocks), backend=args.backend,
                            prefill=args.prefill, admission=args.admission, prefix_cache=args.prefix_cache,
                            max_num_batched_tokens=args.max_num_batched_tokens, replicas=args.replicas,
                            router=args.router)
    table = inputs.load_table(args.table, serving, args.allow_nonstationary)
    inputs.check_backend(table, args.backend)
    trace = inputs.make_trace(rate=args.rate, n=args.n, seed=args.seed, trace_file=args.trace,
                              closed_mixed_n=args.closed_mixed, closed_uniform_prompt=args.closed_uniform,
                              burstiness=args.burstiness, ramp_up_s=args.ramp_up_s)
    if args.trace is not None:
        inputs.check_memory(len(trace), detail)
    pool_blocks, how = inputs.pool_blocks(trace, serving), serving.pool.describe(serving.max_batch)
    inputs.check_trace(trace, table, serving, pool_blocks)
    cfg = SimConfig(serving, detail=detail, fast_forward=not args.no_fast_forward, noise_seed=args.noise_seed)
    with tqdm(total=len(trace), unit="req", desc="simulating", disable=len(trace) < 20_000) as bar:
        cost = CostModel(table, args.strict)
        if args.replicas == 1:
            result = simulate(trace, cost, cfg, on_finish=bar.update)
        else:
            from .fleet import simulate_fleet  # SimPy: only a fleet needs it
            result = simulate_fleet(trace, cost, cfg, on_finish=bar.update)
    rate = trace.meta.get("rate") or trace.offered_rate  # None for a closed run: no stability verdict
    s = summary(result.record, rate, args.slo)
    imported = inputs.import_meta(trace)
    if args.out:
        _write_record(result.record, args.out, args.tokens, s, imported)
    kind = trace.meta.get("kind", "trace file" if args.trace else "trace")
    shape = "".join(f", {k.replace('_s', '')} {v:g}{' s' * k.endswith('_s')}" for k, v in given(args).items())
    print(f"trace    {kind}, {len(trace)} requests" + (f", rate {rate:g}/s" if rate else "") + shape +
          (f", seed {trace.meta['seed']}" if "seed" in trace.meta else "") + f" (trace {trace.trace_id})")
    if imported:
        print(f"import   {imported['import']}")
    memory = f", {args.admission} admission" + ", prefix cache" * args.prefix_cache
    memory += f", step cap {args.max_num_batched_tokens} tokens" if args.max_num_batched_tokens else ""
    print(f"engine   {args.backend}, {args.prefill} prefill{memory}, max batch {args.max_batch}, pool {pool_blocks} "
          f"blocks ({how}); {table.summary()}")
    if args.replicas > 1:
        print(f"fleet    {args.replicas} replicas of that engine behind a {args.router} router")
    if rate:
        print(f"served   {fmt_value(s['served_rate'])} req/s against {fmt_value(s['expected_rate'])} offered: "
              + stability_said(s))
    else:
        print(f"served   {s['n']} requests in {fmt_value(s['wall_time_s'])} s ({fmt_value(s['served_rate'])} req/s)")
    lat = latency_ms(result.record, args.percentiles)
    print("latency\n" + latency_table(lat, args.percentiles, indent="  "))
    print(f"groups   admission group size p50/p95/max {fmt_value(s['group_size_p50'], '.0f')}/"
          f"{fmt_value(s['group_size_p95'], '.0f')}/{fmt_value(s['group_size_max'], '.0f')}; padding waste p50/p95 "
          f"{fmt_value(s['padding_waste_p50'])}/{fmt_value(s['padding_waste_p95'])} padded positions per prompt token")
    waited = "no request waited" if math.isnan(s["rows_while_queued"]) else \
        f"{s['rows_while_queued']:.1f} while requests waited"
    print(f"rows     {fmt_value(s['mean_running_rows'], '.1f')} of {args.max_batch} running on average"
          f"{' per replica' * (args.replicas > 1)}, {waited}; the queue head waited for KV blocks with rows free "
          f"{fmt_value(s['head_blocked_frac'], '.0%')} of step time")
    if "preemptions" in s:
        print(f"memory   {s['preemptions']} preemptions ({fmt_value(s['preempted_frac'], '.1%')} of requests), "
              f"{s['recomputed_tokens']} positions recomputed ({fmt_value(s['recompute_time_frac'], '.1%')} of wall time); "
              f"prefix cache hit rate {fmt_value(s['prefix_hit_rate'], '.1%')} of prompt positions")
    if args.slo:
        print(slo_line(s, args.slo))
    if args.interval:
        print("\n".join(run_interval(args, table, cfg, trace, rate)))
    if args.replicas > 1:
        print(replica_table(per_replica(result.record, rate, args.slo)))
    rejected = len(result.record.rejected)
    if rejected:
        print(f"rejected {rejected} requests the engine refuses (see rejected.csv)")
    print(f"sim      {result.events:,} events ({len(trace):,} requests + {result.steps:,} steps) in "
          f"{result.wall_s:.2f} s ({result.events / result.wall_s:,.0f} events/s)")
    if args.out:
        print(f"wrote    the run record to {args.out}/")
    if args.save_result:
        print(f"wrote    the result to {_save_result(args, result.record, s, table, trace, pool_blocks)}")
    if args.trace_events:
        from servecap.traces.timeline import write_timeline
        print(f"wrote    the timeline to {write_timeline([result.record], args.trace_events)}")
    return 0


def _save_result(args: argparse.Namespace, rec, s: dict, table, trace, pool_blocks: int) -> Path:
    from servecap.traces.bench_result import bench_result, write_result
    from servecap.traces.provenance import provenance
    config = {"backend": args.backend, "prefill": args.prefill, "max_batch": args.max_batch, "pool_blocks": pool_blocks,
              "replicas": args.replicas, "router": args.router, "block_size": table.block_size,
              "noise_seed": args.noise_seed, "strict": args.strict}
    prov = {"table_id": table.table_id, "trace_id": trace.trace_id, "trace": trace.meta, **inputs.import_meta(trace),
            "seed": trace.meta.get("seed"), "config": config,
            "command": shlex.join(["python", "-m", "sim", *args.argv]), **provenance()}
    doc = bench_result(rec, s, backend="servecap-sim", percentiles=args.percentiles, slos=args.slo, provenance=prov)
    return write_result(args.save_result, doc)


def cmd_sweep(args: argparse.Namespace) -> int:
    with ExitStack() as held:
        return _sweep(args, held)


def _sweep(args: argparse.Namespace, held: ExitStack) -> int:
    if args.trace is not None:
        _refuse_unused(args, {"--n": "with --trace: the trace file holds the requests",
                              "--seed": "with --trace: the trace file holds the requests",
                              "--seeds": "with --trace: one trace file is one sample (seeds draw Poisson traces)"})
        if given(args):
            raise InputError("--burstiness and --ramp-up-s shape the seeded trace; a trace file keeps its own arrivals")
    if args.on != "local":
        _refuse_unused(args, {"--jobs": f"with --on {args.on}: its containers run the points"})
    if max(args.replicas) == 1:
        _refuse_unused(args, {"--router": "with one replica: there is nothing to route between (--replicas N,M)"})
    args.router = args.router or ["round-robin"]
    seeds = args.seeds or [0 if args.seed is None else args.seed]
    n = DEFAULT_N if args.n is None else args.n
    _check_sweep_out(args)  # before any work
    from servecap.traces.provenance import provenance

    from .fleet_report import fewest_lines, fewest_replicas
    from .report import report, write_files
    table = inputs.load_table(args.table, ServingConfig(block_size=args.block_size), args.allow_nonstationary)
    for b in args.backend:
        inputs.check_backend(table, b)
    workload = Workload(n, seeds[0], inputs.load_trace(args.trace) if args.trace else None, args.burstiness,
                        args.ramp_up_s)
    if workload.base is not None and workload.base.offered_rate is None:
        raise InputError("every request of this trace arrives at once, so it cannot be scaled to arrival rates; "
                         "simulate it with `sim run --trace`", path=args.trace)
    configs = list(dict.fromkeys(ServingConfig(block_size=args.block_size, max_batch=m, pool=PoolSize(gib=g),
                                               backend=b, prefill=p, admission=a, prefix_cache=c, replicas=k,
                                               router=r, max_num_batched_tokens=args.max_num_batched_tokens)
                                 for b in args.backend for p in args.prefill for a in args.admission
                                 for c in args.prefix_cache for m in args.max_batch for g in args.pool_gib
                                 for r in args.router for k in args.replicas))
    rates = None if args.rates is None else sorted(set(args.rates))
    points = len(configs) * len(seeds) * (AUTO_POINTS if rates is None else len(rates))
    workers = min(args.jobs or os.cpu_count() or 1, points) if args.on == "local" else 1  # Modal's are its own
    inputs.check_memory(len(workload.base) if workload.base else n, processes=workers)
    # The same requests at every rate: one trace per seed
    samples = [workload.base] if workload.base else [replace(workload, seed=s).at(1.0) for s in seeds]
    for c in configs:
        for requests, seed in zip(samples, seeds):
            pool_blocks = inputs.pool_blocks(requests, c)
            try:
                inputs.check_trace(requests, table, c, pool_blocks)
            except InputError as e:
                on = f", seed {seed}" if len(samples) > 1 else ""
                raise InputError(f"{c.label} ({pool_blocks} blocks{on}): {e}") from None
    wl = {"trace_file": str(args.trace), "trace_id": samples[0].trace_id, "n": len(samples[0])} if args.trace else \
        {"kind": "poisson" if args.burstiness == 1.0 else "gamma", "n": n, **given(args),
         **({"seeds": seeds} if len(seeds) > 1 else {"seed": seeds[0]})}
    setup = {"table_id": table.table_id, "workload": wl, "configs": [c.axes() for c in configs],
             "rates": "auto" if rates is None else rates, "block_size": table.block_size,
             "noise_seed": args.noise_seed, "strict": args.strict, "slos": [str(slo) for slo in args.slo],
             # only when not the default, so that a sweep interrupted before the option existed still resumes
             **({"percentiles": list(args.percentiles)} if args.percentiles != DEFAULT_PERCENTILES else {})}
    what = inputs.described(args.trace, samples[0]) if args.trace else \
        f"the seeded Poisson trace, {n} requests, " + (f"seed {seeds[0]}" if len(seeds) == 1 else
                                                        f"{len(seeds)} seeds ({_seed_text(seeds)})")
    print(f"sweep: {len(configs)} configuration{'s' * (len(configs) > 1)} on {what}; {table.summary()}")
    if args.rates is None:
        print(f"rates: auto. Each configuration's capacity is estimated from one saturated run (all its requests "
              f"queued at t=0{', first seed' if len(seeds) > 1 else ''}); its {AUTO_POINTS} rates span "
              f"{AUTO_SPAN[0]}x to {AUTO_SPAN[1]}x that estimate")
    with _points_on(args.on) as remote:  # before the points file: a sweep Modal cannot run leaves nothing behind
        held.enter_context(exclusive(args.out, "sweep"))  # until the sweep's files are written
        store = PointStore(args.out / FILE, setup, resume=args.resume)
        if args.resume:
            print(f"resuming: {len(store.done)} results already in {store.path}")
        t0 = time.perf_counter()
        try:
            results, warned = run_sweep(table, configs, rates, workload, seeds=seeds, strict=args.strict,
                                        noise_seed=args.noise_seed, jobs=args.jobs, slos=args.slo, remote=remote,
                                        store=store, percentiles=args.percentiles, interval=args.interval)
        except KeyboardInterrupt:
            again = [a for a in args.argv if a not in ("--force", "--resume")] + ["--resume"]
            print(f"\nsim: interrupted: {len(store.done)} finished results are kept in {store.path}; complete the "
                  f"sweep with: {shlex.join(['python', '-m', 'sim', *again])}", file=sys.stderr)
            return 130
        finally:
            store.close()
    for w in warned:  # said in the workers
        warnings.warn(w, stacklevel=1)
    print(report(results, args.slo, args.percentiles))
    fewest = fewest_replicas(results, args.slo) if len(set(args.replicas)) > 1 else None
    if fewest is not None:
        print("\n" + "\n".join(fewest_lines(fewest, args.slo)))
    meta = {"table": {"id": table.table_id, "device": table.device_name, "gpu_uuid": table.gpu_uuid,
                      "path": str(args.table or inputs.SHIPPED_TABLE)},
            "workload": wl, **inputs.import_meta(samples[0]), "rates": setup["rates"], "block_size": table.block_size,
            "noise_seed": args.noise_seed, "strict": args.strict, "warnings": warned,
            "slos": setup["slos"], "capacity_by": "slos" if args.slo else "stability",
            **({"fewest_replicas": fewest} if fewest is not None else {}),
            **({"interval": args.interval} if args.interval else {})}
    run = {"on": args.on, "command": shlex.join(["python", "-m", "sim", *args.argv]), **provenance(),
           "wall_s": round(time.perf_counter() - t0, 3)}
    files = write_files(args.out, results, meta, run, args.slo, args.percentiles)
    if args.interval:
        files.append(write_sweep_intervals(args.out, results, args.interval))
    for stale in set(SWEEP_FILES) - {f.name for f in files} - {FILE}:  # a replaced sweep's, this one did not write
        (args.out / stale).unlink(missing_ok=True)
    events = sum(r["sim_events"] for res in results for r in res.rows)
    print(f"\n{sum(len(res.rows) for res in results)} points, {events:,} events in {time.perf_counter() - t0:.1f} s; "
          f"wrote " + ", ".join(str(f) for f in files))
    return 0


def write_sweep_intervals(out: Path, results, level: float) -> Path:
    """sweep.intervals.csv: the bands run_sweep gave each point of the first seed (servecap/sim/intervals.py)."""
    import pandas as pd

    from .intervals import INTERVALS_FILE, METRICS
    path = out / INTERVALS_FILE
    rows = [{"config": res.config.label, "rate": rate, "level": level,  # in METRICS' order, also when resumed
             **{f"{k}_{side}": bands[k][side] for k in METRICS if k in bands for side in ("lo", "hi")}}
            for res in results for rate, bands in zip(res.rates, res.bands)]
    pd.DataFrame(rows).to_csv(path, index=False)
    return path


def _seed_text(seeds: list[int]) -> str:
    return f"{seeds[0]}-{seeds[-1]}" if seeds == list(range(seeds[0], seeds[-1] + 1)) else ",".join(map(str, seeds))


@contextmanager
def _points_on(where: str) -> Iterator[RemoteMap | None]:
    """None for local worker processes; for Modal, a map onto its containers while its app runs."""
    if where == "local":
        yield None
        return
    try:
        from . import modal_app
    except ModuleNotFoundError as e:
        if e.name != "modal":
            raise
        raise InputError("--on modal needs the modal package: pip install -e '.[modal]', then modal setup") from None
    with modal_app.mapper() as remote:
        yield remote


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
