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
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from tqdm import tqdm

from costs.model import CostModel
from costs.shapes import BACKENDS
from engine.block_pool import DEFAULT_BLOCK_SIZE
from engine.scheduler import PrefillPolicy
from traces.cli import SLO_HELP, checked, count_arg, rate_arg, seed_arg, slo_arg
from traces.errors import InputError
from traces.metrics import per_replica, summary
from traces.prompts import PROMPT_NAMES
from traces.provenance import provenance
from traces.records import TABLES, RunWriter
from traces.workload import DEFAULT_N, poisson_trace

from . import inputs
from .fleet import simulate_fleet
from .fleet_report import fewest_lines, fewest_replicas, replica_table, slo_line
from .report import report, write_files
from .routing import ROUTERS
from .simulator import SimConfig, simulate
from .sweep import AUTO_POINTS, AUTO_SPAN, Config, RemoteMap, Workload, run_sweep

DEFAULT_OUT = Path("sim-out")
SUBCOMMANDS = ("run", "sweep")


def _list(item: Callable[[str], object]) -> Callable[[str], list]:
    return lambda text: [item(t.strip()) for t in text.split(",") if t.strip()] or item("")


_gib = checked(float, lambda v: math.isfinite(v) and v > 0, "a positive number of GiB")
_backend = checked(str, lambda v: v in BACKENDS, f"a backend ({', '.join(BACKENDS)})")
_router = checked(str, lambda v: v in ROUTERS, f"a router ({', '.join(ROUTERS)})")


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
    run.add_argument("--replicas", type=count_arg, default=1,
                     help="engines of this configuration behind a router, each with its own rows and pool (default 1)")
    run.add_argument("--router", type=_router, default="round-robin",
                     help=f"how the router picks a replica: {', '.join(ROUTERS)} (default round-robin)")
    run.add_argument("--slo", type=slo_arg, default=(), metavar="SPEC", help=SLO_HELP)
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
    sweep.add_argument("--replicas", type=_list(count_arg), default=[1], metavar="N1,N2,...",
                       help="fleet sizes: engines behind a router (default 1); with more than one, the sweep also "
                            "says the fewest replicas that hold each rate")
    sweep.add_argument("--router", type=_list(_router), default=["round-robin"], metavar="R1,R2,...",
                       help=f"routers: {', '.join(ROUTERS)} (default round-robin)")
    sweep.add_argument("--slo", type=slo_arg, default=(), metavar="SPEC",
                       help=SLO_HELP + "; capacity is then defined by the SLOs")
    sweep.add_argument("--on", choices=("local", "modal"), default="local",
                       help="where the points run: local worker processes (default) or Modal containers "
                            "(sim/modal_app.py; needs the modal package and a Modal token)")
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
    if out is not None and any((out / f"{t}.csv").exists() for t in TABLES):
        raise InputError("already holds a run record; choose a new output directory", path=out)


def _write_record(rec, out: Path, tokens: bool, scored: dict) -> None:
    # Written only once the run has succeeded, so a refused or failed run leaves nothing behind.
    tables = ("requests", "steps", "rejected") + (("tokens",) if tokens else ())
    writer = RunWriter(out, {**rec.meta, **provenance()}, tables)
    for t in tables:
        writer.add_many(t, getattr(rec, t).itertuples(index=False, name=None))
    writer.close(summary=scored)


def _fmt(v: float, spec: str = ".2f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def cmd_run(args: argparse.Namespace) -> int:
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
        cost = CostModel(table, args.strict)
        result = simulate(trace, cost, cfg, on_finish=bar.update) if args.replicas == 1 else \
            simulate_fleet(trace, cost, cfg, args.replicas, args.router, on_finish=bar.update)
    rate = trace.meta.get("rate") or trace.offered_rate  # None for a closed run: no stability verdict
    s = summary(result.record, rate, args.slo)
    if args.out:
        _write_record(result.record, args.out, args.tokens, s)
    kind = trace.meta.get("kind", "trace file" if args.trace else "trace")
    print(f"trace    {kind}, {len(trace)} requests" + (f", rate {rate:g}/s" if rate else "") +
          (f", seed {trace.meta['seed']}" if "seed" in trace.meta else "") + f" (trace {trace.trace_id})")
    print(f"engine   {args.backend}, {args.prefill} prefill, max batch {args.max_batch}, pool {pool_blocks} blocks "
          f"({how}); {table.summary()}")
    if args.replicas > 1:
        print(f"fleet    {args.replicas} replicas of that engine behind a {args.router} router")
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
    print(f"rows     {_fmt(s['mean_running_rows'], '.1f')} of {args.max_batch} running on average"
          f"{' per replica' * (args.replicas > 1)}, {waited}; the queue head waited for KV blocks with rows free "
          f"{_fmt(s['head_blocked_frac'], '.0%')} of step time")
    if args.slo:
        print(slo_line(s, args.slo))
    if args.replicas > 1:
        print(replica_table(per_replica(result.record, rate, args.slo)))
    rejected = len(result.record.rejected)
    if rejected:
        print(f"rejected {rejected} requests the engine refuses (see rejected.csv)")
    print(f"sim      {result.events:,} events ({len(trace):,} requests + {result.steps:,} steps) in "
          f"{result.wall_s:.2f} s ({result.events / result.wall_s:,.0f} events/s)")
    if args.out:
        print(f"wrote    the run record to {args.out}/")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    table = inputs.load_table(args.table, args.block_size, args.allow_nonstationary)
    for b in args.backend:
        inputs.check_backend(table, b)
    workload = Workload(args.n, args.seed, inputs.load_trace(args.trace) if args.trace else None)
    if workload.base is not None and workload.base.offered_rate is None:
        raise InputError("every request of this trace arrives at once, so it cannot be scaled to arrival rates; "
                         "simulate it with `sim run --trace`", path=args.trace)
    requests = workload.base or poisson_trace(1.0, args.n, args.seed)  # the same requests at every rate
    configs = list(dict.fromkeys(Config(b, m, g, p, n, r) for b in args.backend for p in args.prefill
                                 for m in args.max_batch for g in args.pool_gib for r in args.router
                                 for n in args.replicas))
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
    with _points_on(args.on) as remote:
        results, warned = run_sweep(table, configs, rates, workload, strict=args.strict, noise_seed=args.noise_seed,
                                    jobs=args.jobs, slos=args.slo, remote=remote)
    for w in warned:
        _warn(w)
    print(report(results, args.slo))
    fewest = fewest_replicas(results, args.slo) if len(set(args.replicas)) > 1 else None
    if fewest is not None:
        print("\n" + "\n".join(fewest_lines(fewest, args.slo)))
    meta = {"table": {"id": table.table_id, "device": table.device_name, "gpu_uuid": table.gpu_uuid,
                      "path": str(args.table or inputs.SHIPPED_TABLE)},
            "workload": {"trace_file": str(args.trace), "trace_id": requests.trace_id} if args.trace else
            {"kind": "poisson", "n": args.n, "seed": args.seed},
            "rates": "auto" if rates is None else rates, "block_size": table.block_size,
            "noise_seed": args.noise_seed, "strict": args.strict, "warnings": warned, "on": args.on,
            "slos": [str(slo) for slo in args.slo], "capacity_by": "slos" if args.slo else "stability",
            **({"fewest_replicas": fewest} if fewest is not None else {}),
            "command": shlex.join(["python", "-m", "sim", *args.argv]), **provenance()}
    files = write_files(args.out, results, meta, args.slo)
    events = sum(r["sim_events"] for res in results for r in res.rows)
    print(f"\n{sum(len(res.rows) for res in results)} points, {events:,} events in {time.perf_counter() - t0:.1f} s; "
          f"wrote " + ", ".join(str(f) for f in files))
    return 0


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
