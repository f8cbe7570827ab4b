"""`python -m sim sweep` (and `python -m sim` with no command): a grid of configurations at many rates on every core
or on Modal, resumable, with its report, figure and files (servecap/sim/sweep.py runs it, report.py says it)."""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
import warnings
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

from servecap.core.block_pool import PoolSize
from servecap.core.config import ServingConfig
from servecap.core.options import add_scheduler_options, policy_arg as _policy
from servecap.core.routing import ROUTERS
from servecap.traces.arrival_options import add_arrival_options, given
from servecap.traces.arg_types import (SLO_HELP, batch_arg, count_arg, gib_arg, level_arg, rate_arg, requests_arg,
                                       seed_arg, slo_arg)
from servecap.traces.errors import InputError
from servecap.traces.latency import DEFAULT_PERCENTILES, PERCENTILES_HELP, percentiles_arg
from servecap.traces.outpath import check_out_dir, exclusive
from servecap.traces.workload import DEFAULT_N

from . import inputs
from .arg_types import backend_arg, list_of, refuse_unused, router_arg, seeds_arg
from .store import FILE, PointStore
from .sweep import AUTO_POINTS, AUTO_SPAN, RemoteMap, Workload, run_sweep

# pandas, SimPy, tqdm and matplotlib are imported where the command runs (servecap/sim/cli.py says why).

DEFAULT_OUT = Path("sim-out")


def _rates(text: str) -> list[float] | None:
    return None if text.strip() == "auto" else list_of(rate_arg)(text)


def add_parser(sub, common: Callable[[argparse.ArgumentParser], None]) -> None:
    sweep = sub.add_parser("sweep", help="simulate a grid of rates x pools x batch sizes x backends x fleets in "
                                         "parallel", description=(
        "Simulate every configuration at every arrival rate on all local cores (or on Modal: --on modal), keeping "
        "each point in --out as it finishes (--resume completes an interrupted sweep); print a table, a capacity "
        "bracket and the mechanism per configuration and last the configurations ranked by capacity, and write "
        "sweep.csv, sweep.json and sweep.png (the same bytes each time), with sweep.run.json: when, where and how "
        "fast it ran."))
    sweep.add_argument("--rates", type=_rates, default=None, metavar="R1,R2,...|auto",
                       help=f"arrival rates in requests/s, or 'auto' (default): {AUTO_POINTS} rates from "
                            f"{AUTO_SPAN[0]}x to {AUTO_SPAN[1]}x each configuration's estimated capacity")
    sweep.add_argument("--pool-gib", type=list_of(gib_arg), default=[0.5, 1, 2, 4], metavar="G1,G2,...",
                       help="KV pool sizes in GiB (default 0.5,1,2,4)")
    sweep.add_argument("--max-batch", "--max-num-seqs", type=list_of(batch_arg), default=[16, 32],
                       metavar="B1,B2,...", help="batch rows (vLLM's max_num_seqs) (default 16,32)")
    sweep.add_argument("--backend", type=list_of(backend_arg), metavar="paged,dense",
                       help="decode backends (default: every one the table prices; padded is the old name of dense)")
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
                            " each point's seeds x its cost draws, so slower)")
    common(sweep)
    sweep.set_defaults(func=cmd_sweep)


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


def cmd_sweep(args: argparse.Namespace) -> int:
    with ExitStack() as held:
        return _sweep(args, held)


def _sweep(args: argparse.Namespace, held: ExitStack) -> int:
    if args.trace is not None:
        refuse_unused(args, {"--n": "with --trace: the trace file holds the requests",
                              "--seed": "with --trace: the trace file holds the requests",
                              "--seeds": "with --trace: one trace file is one sample (seeds draw Poisson traces)"})
        if given(args):
            raise InputError("--burstiness and --ramp-up-s shape the seeded trace; a trace file keeps its own arrivals")
    if args.on != "local":
        refuse_unused(args, {"--jobs": f"with --on {args.on}: its containers run the points"})
    if max(args.replicas) == 1:
        refuse_unused(args, {"--router": "with one replica: there is nothing to route between (--replicas N,M)"})
    args.router = args.router or ["round-robin"]
    seeds = args.seeds or [0 if args.seed is None else args.seed]
    n = DEFAULT_N if args.n is None else args.n
    _check_sweep_out(args)  # before any work
    from servecap.traces.provenance import provenance

    from .fleet_report import fewest_lines, fewest_replicas
    from .report import report, write_files
    table = inputs.load_table(args.table, ServingConfig(block_size=args.block_size), args.allow_nonstationary)
    args.backend = args.backend or list(table.backends)
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


