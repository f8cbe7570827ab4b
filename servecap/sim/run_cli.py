"""`python -m sim run`: one trace at one configuration simulated, its summary printed (with --interval, a band for
every metric), and with --out its run record in the engine's schema."""
from __future__ import annotations

import argparse
import math
import os
import shlex
from pathlib import Path
from typing import Callable

from servecap.core.block_pool import PoolSize
from servecap.core.config import ServingConfig
from servecap.core.options import PREFILL_HELP, add_scheduler_options, policy_arg as _policy
from servecap.core.routing import ROUTERS
from servecap.traces.arrival_options import add_workload_options, given
from servecap.traces.arg_types import SLO_HELP, batch_arg, blocks_arg, count_arg, gib_arg, level_arg, slo_arg
from servecap.traces.errors import InputError
from servecap.traces.formatting import fmt_value
from servecap.traces.latency import DEFAULT_PERCENTILES, PERCENTILES_HELP, percentiles_arg
from servecap.traces.outpath import check_out_dir, check_trace_events
from servecap.traces.workload import DEFAULT_N

from . import inputs
from .arg_types import backend_arg, refuse_unused, router_arg

# pandas, SimPy, tqdm and matplotlib are imported where the command runs (servecap/sim/cli.py says why).


def add_parser(sub, common: Callable[[argparse.ArgumentParser], None]) -> None:
    run = sub.add_parser("run", help="simulate one point and print its summary", description=(
        "Simulate one trace at one configuration and print its summary; --out writes the full run record "
        "(the engine's schema). The trace: --rate (seeded Poisson), --trace FILE, --closed-mixed or --closed-uniform."))
    add_workload_options(run)
    run.add_argument("--backend", type=backend_arg, default="paged",
                     help="decode backend: paged or dense (every row read at the widest; old name padded) (default paged)")
    run.add_argument("--max-batch", "--max-num-seqs", type=batch_arg, default=32,
                     help="batch rows (vLLM's max_num_seqs) (default %(default)s)")
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
    common(run)
    run.set_defaults(func=cmd_run)


def _check_out(out: Path | None) -> None:
    from servecap.traces.records import TABLES
    if out is None:
        return
    check_out_dir(out)
    if any((out / f"{t}.csv").exists() for t in TABLES):
        raise InputError("already holds a run record; choose a new output directory", path=out)


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
    """`sim run --interval`: the point's bands (a trace file or a closed uniform run is one trace sample), and how far
    a percent of speed moves each metric on the trace simulated."""
    from . import intervals
    iv = intervals.Intervals(table, args.interval)
    if args.trace is None and args.closed_uniform is None:
        traces = intervals.seeded(lambda seed: inputs.make_trace(rate=args.rate, n=args.n, seed=seed,
                                                                 closed_mixed_n=args.closed_mixed), args.seed)
    else:
        traces = [trace]
    run = intervals.simulated(cfg, rate)
    bands = iv.band(traces, run, progress=True, jobs=args.jobs or os.cpu_count() or 1)
    return [*intervals.lines(bands, iv, len(traces)), intervals.speed_line(intervals.speed_slopes(run, trace, table))]


def cmd_run(args: argparse.Namespace) -> int:
    if args.trace is not None:
        refuse_unused(args, {"--n": "with --trace: the trace file holds the requests",
                              "--seed": "with --trace: the trace file holds the requests"})
    elif args.closed_mixed is not None:
        refuse_unused(args, {"--n": "with --closed-mixed N: N is the number of requests"})
    elif args.closed_uniform is not None:
        refuse_unused(args, {"--seed": "with --closed-uniform: every request is the same prompt"})
    if args.out is None:
        refuse_unused(args, {"--tokens": "without --out: the token rows are written into the run record"})
    if args.interval is None:
        refuse_unused(args, {"--jobs": "without --interval: a run is one process"})
    if args.replicas == 1:
        refuse_unused(args, {"--router": "with one replica: there is nothing to route between (--replicas N)"})
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


