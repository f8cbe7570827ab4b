"""`python -m sim capacity`: the highest rate a configuration holds, or the fewest replicas for a rate or for each
window of a trace, by search (servecap/sim/capacity.py), with the band across workload seeds."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Callable

from servecap.core.block_pool import PoolSize
from servecap.core.config import ServingConfig
from servecap.core.routing import ROUTERS
from servecap.traces.arg_types import (SLO_HELP, batch_arg, checked, count_arg, gib_arg, level_arg, positive_arg,
                                       rate_arg, requests_arg, seed_arg, slo_arg)
from servecap.traces.arrival_options import add_arrival_options, given
from servecap.traces.errors import InputError
from servecap.traces.outpath import check_new_file
from servecap.traces.slo import describe
from servecap.traces.workload import DEFAULT_N

from . import capacity, inputs, intervals, sweep, workers
from .arg_types import backend_arg, router_arg, seeds_arg
from .sweep import Workload

_tolerance = checked(float, lambda v: 0 < v < 1, "a fraction between 0 and 1 (e.g. 0.01)")


def add_parser(sub, common: Callable[[argparse.ArgumentParser], None]) -> None:
    from servecap.core.options import PREFILL_HELP, add_scheduler_options, policy_arg as _policy

    p = sub.add_parser("capacity", help="the highest rate that meets the SLOs (or stays stable), or the fewest "
                                        "replicas for a rate or each window of a trace, by search", description=(
        "Search, rather than sweep, for capacity: with no --rate, the highest arrival rate at which the configuration "
        "meets its --slo (without SLOs: stays stable), by bisection to --tolerance; with --rate, the fewest replicas "
        "that hold it; with --trace and --window-s, the fewest replicas for each window of the trace at its own rate. "
        "Every probe is a sweep point (the same verdict `sim sweep` gives at that rate); the search runs on each seed "
        "of --seeds and reports min, median and max."))
    p.add_argument("--backend", type=backend_arg, default="paged", help="decode backend (default paged)")
    p.add_argument("--max-batch", "--max-num-seqs", type=batch_arg, default=32,
                   help="batch rows (vLLM's max_num_seqs) (default %(default)s)")
    p.add_argument("--prefill", type=_policy, default="padded", metavar="POLICY", help=PREFILL_HELP + " (default padded)")
    add_scheduler_options(p)
    p.add_argument("--pool-gib", type=gib_arg, default=4.0, help="KV pool size in GiB (default %(default)s)")
    p.add_argument("--replicas", type=count_arg, default=1,
                   help="engines behind a router, for the rate search (default 1)")
    p.add_argument("--router", type=router_arg, default="round-robin",
                   help=f"{', '.join(ROUTERS)} (default round-robin)")
    p.add_argument("--slo", type=slo_arg, default=(), metavar="SPEC", help=SLO_HELP)
    p.add_argument("--rate", type=rate_arg, help="find the fewest replicas that hold this rate (requests/s)")
    p.add_argument("--trace", type=Path, help="a request-trace file: scaled to each probed rate, or with --window-s "
                                              "cut into windows run at their own rates")
    p.add_argument("--window-s", type=positive_arg, metavar="S",
                   help="with --trace: the fewest replicas for each S-second window of its arrivals")
    p.add_argument("--max-replicas", type=count_arg, default=capacity.MAX_REPLICAS,
                   help="the most replicas a replica search tries (default %(default)s)")
    p.add_argument("--tolerance", type=_tolerance, default=capacity.REL_TOL,
                   help="the rate search stops when the rate that failed is within this fraction of the one that "
                        "held (default %(default)s)")
    p.add_argument("--n", type=requests_arg, help=f"requests of the seeded trace (default {DEFAULT_N})")
    seeds = p.add_mutually_exclusive_group()
    seeds.add_argument("--seed", type=seed_arg, help="workload seed (default 0)")
    seeds.add_argument("--seeds", type=seeds_arg, metavar="A-B|S1,S2,...",
                       help="search on each of these workload seeds and report min, median and max")
    add_arrival_options(p)
    p.add_argument("--interval", type=level_arg, metavar="LEVEL",
                   help="also the answer's LEVEL%% band over the cost model's uncertainty (its held-out error and the "
                        "GPU-to-GPU spread, servecap/sim/intervals.py): each search again with every step cost at the "
                        "band's two edge factors (capacity falls as steps cost more); the engine's run-to-run noise "
                        "beyond speed is not in it")
    p.add_argument("--jobs", type=count_arg, help="seeds searched in parallel (default: every core)")
    p.add_argument("--out", type=Path, metavar="FILE.json",
                   help="also write the answer as JSON: every search's probes, the band, the configuration, the "
                        "table, the trace and how it was run (git commit, software, command)")
    p.add_argument("--force", action="store_true", help="replace an existing --out FILE.json")
    common(p)
    p.set_defaults(func=cmd_capacity)


def _check(args: argparse.Namespace) -> None:
    if args.window_s is not None and args.trace is None:
        raise InputError("--window-s cuts a trace into windows; give --trace")
    if args.window_s is not None and args.rate is not None:
        raise InputError("--rate does nothing with --window-s: each window runs at its own rate")
    if args.trace is not None and (args.n is not None or args.seed is not None or args.seeds or given(args)):
        raise InputError("--n, --seed(s), --burstiness and --ramp-up-s shape the seeded trace; a trace file keeps its "
                         "own requests")
    if args.interval is not None and args.window_s is not None:
        raise InputError("--interval bands the rate and replica searches, not --window-s's windows")
    if (args.rate is not None or args.window_s is not None) and args.replicas != 1:
        raise InputError("--replicas does nothing with --rate or --window-s: the search finds the fewest replicas")


def cmd_capacity(args: argparse.Namespace) -> int:
    _check(args)
    if args.out is not None:
        check_new_file(args.out, force=args.force, keep={"the input trace (--trace)": args.trace,
                                                         "the cost table (--table)": args.table})
    elif args.force:
        raise InputError("--force does nothing without --out (the only file this command writes)")
    config = ServingConfig(block_size=args.block_size, max_batch=args.max_batch, pool=PoolSize(gib=args.pool_gib),
                           backend=args.backend, prefill=args.prefill, admission=args.admission,
                           prefix_cache=args.prefix_cache, max_num_batched_tokens=args.max_num_batched_tokens,
                           replicas=args.replicas, router=args.router)
    table = inputs.load_table(args.table, config, args.allow_nonstationary)
    inputs.check_backend(table, args.backend)
    seeds = args.seeds or [0 if args.seed is None else args.seed]
    base = inputs.load_trace(args.trace) if args.trace else None
    workload = Workload(DEFAULT_N if args.n is None else args.n, seeds[0], base, args.burstiness, args.ramp_up_s)
    samples = [base] if base is not None else [Workload(workload.n, s, None, args.burstiness, args.ramp_up_s).at(1.0)
                                               for s in seeds]
    for s in samples:
        inputs.check_trace(s, table, config, inputs.pool_blocks(s, config))
    by = f"meets {describe(args.slo)} for all but 1% of requests, every named tail within its limit" if args.slo \
        else "stays stable (served rate within 3% of offered, queue wait not rising)"
    what = inputs.described(args.trace, base) if base is not None else \
        f"the seeded {'Poisson' if args.burstiness == 1 else f'gamma (burstiness {args.burstiness:g})'} trace, " \
        f"{workload.n} requests" + (f", ramp-up {args.ramp_up_s:g} s" if args.ramp_up_s else "")
    print(f"capacity: {config.label} ({inputs.pool_blocks(samples[0], config)} blocks) on {what}; a point holds when "
          f"it {by}; {table.summary()}")
    doc = {"schema": "capacity", "version": 1, "configuration": {"label": config.label, **config.axes()},
           "table": {"id": table.table_id, "device": table.device_name, "gpu_uuid": table.gpu_uuid,
                     "path": str(args.table or inputs.SHIPPED_TABLE)},
           "workload": {"trace": str(args.trace), "trace_id": base.trace_id} if base is not None else
           {"kind": "poisson", "n": workload.n, "seeds": seeds, "burstiness": args.burstiness,
            "ramp_up_s": args.ramp_up_s},
           "holds_when": by, "slos": [str(slo) for slo in args.slo]}
    if args.window_s is not None:
        doc.update(search="fewest replicas per window", window_s=args.window_s,
                   windows=_windows(args, table, config, base))
        return _write(args, doc)
    if base is not None and base.offered_rate is None:
        raise InputError("every request of this trace arrives at once, so it cannot be run at a rate", path=args.trace)
    init = (table, args.strict, workload, args.noise_seed, args.slo)
    if args.rate is None:
        fn, calls, name, unit = capacity.max_rate, [(config, s, args.slo, args.tolerance) for s in seeds], \
            "highest rate that holds", "req/s"
    else:
        fn, calls, name, unit = capacity.fewest_replicas, \
            [(config, args.rate, s, args.slo, args.max_replicas, args.router) for s in seeds], "fewest replicas", ""
    found = _per_seed(init, fn, calls, args.jobs, _probe_unit(args))
    for f in found:
        if args.rate is None:
            print(f"seed {f.seed}: " + (f"highest rate that holds {f.answer:.4g} req/s" if f.answer is not None else
                                        "no rate held") +
                  (f", {f.bound:.4g} fails" if f.bound is not None else ", no probed rate failed") +
                  f" ({len(f.probes)} probes from the saturated estimate {f.estimate:.4g} req/s)")
        else:
            print(f"seed {f.seed}: rate {args.rate:g} req/s -> " +
                  _replicas(f.answer, args.max_replicas) +
                  f" ({', '.join(f'{k}: ' + ('holds' if ok else 'fails') for k, ok in sorted(f.probes))})")
    _band(name, [f.answer for f in found], unit)
    doc.update(search=name, unit=_probe_unit(args), **({"rate": args.rate} if args.rate is not None else {}),
               tolerance=args.tolerance if args.rate is None else None, searches=[_searched(f) for f in found],
               band=capacity.band([f.answer for f in found]))
    if args.interval is not None:
        doc["interval"] = _interval(args, table, init, fn, calls, found, name, unit)
    return _write(args, doc)


def _probes(f: capacity.Search) -> list[dict]:
    return [{"value": v, "holds": held} for v, held in f.probes]


def _searched(f: capacity.Search) -> dict:
    return {"seed": f.seed, "answer": f.answer, "bound": f.bound, "estimate": f.estimate, "probes": _probes(f)}


def _write(args: argparse.Namespace, doc: dict) -> int:
    if args.out is not None:
        from servecap.traces.bench_result import json_safe
        from servecap.traces.csvio import atomic_write_text
        from servecap.traces.provenance import provenance
        doc.update(command=shlex.join(["python", "-m", "sim", *args.argv]), **provenance())
        atomic_write_text(args.out, json.dumps(json_safe(doc), indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


def _interval(args: argparse.Namespace, table, init: tuple, fn, calls: list[tuple], found: list, name: str,
              unit: str) -> dict:
    """The searches again at the band's edge cost draws: the cheaper edge's answer and the dearer edge's bound
    the answer's band (a capacity rises, a replica count falls, as steps cost less)."""
    cheap, dear, cost = intervals.edge_factors(table, args.interval)
    draws = {"cheap": cheap, "dear": dear}
    said = {k: intervals.describe_draw(d) for k, d in draws.items()}
    resolution = f"; each edge, like the answer, found to within --tolerance {args.tolerance:.1%}" \
        if args.rate is None else ""
    print(f"interval {args.interval:g}%: each search again with {said['cheap']} and {said['dear']} "
          f"({intervals.describe_sigma(cost)}); the engine's run-to-run noise beyond speed is not in it{resolution}")
    edges = {k: _per_seed((intervals.scaled_table(table, d), *init[1:]), fn, calls, args.jobs, _probe_unit(args),
                          f"{said[k]}, ")
             for k, d in draws.items()}
    low, high = ("dear", "cheap") if args.rate is None else ("cheap", "dear")
    show = (lambda v: "none" if v is None else f"{v:.4g}") if args.rate is None else \
        (lambda v: f"more than {args.max_replicas}" if v is None else f"{v}")
    for i, f in enumerate(found):
        print(f"seed {f.seed}: {name} {show(f.answer)}{' ' + unit if unit else ''}, {args.interval:g}% interval "
              f"{show(edges[low][i].answer)} .. {show(edges[high][i].answer)}{' ' + unit if unit else ''} "
              f"({said[low]} .. {said[high]})")
    if len(found) > 1:
        for which, k in (("lower", low), ("upper", high)):
            _band(f"the interval's {which} edge", [f.answer for f in edges[k]], unit)
    return {"level": args.interval, "cost_sigma": cost["sigma"],
            "edges": [{"edge": which, "step_cost_factors": draws[k], "searches": [_searched(f) for f in edges[k]]}
                      for which, k in (("lower", low), ("upper", high))]}


def _band(name: str, values: list, unit: str) -> None:
    b = capacity.band(values)
    if len(values) == 1:
        return
    missing = "" if b["found"] == b["seeds"] else f" ({b['seeds'] - b['found']} seeds found none)"
    if b["found"]:
        print(f"{name} across {b['seeds']} seeds: min {b['min']:.4g}, median {b['median']:.4g}, max {b['max']:.4g}"
              f"{' ' + unit if unit else ''}{missing}")
    else:
        print(f"{name}: none on any of {b['seeds']} seeds")


def _replicas(answer: int | None, most: int) -> str:
    """A replica search's answer in words: '1 replica', '3 replicas', or none of those it tried."""
    return f"none of 1-{most} replicas" if answer is None else f"{answer} replica{'s' * (answer != 1)}"


def _probe_unit(args: argparse.Namespace) -> str:
    """What the search probes: rates (no --rate given) or replica counts at --rate."""
    return "req/s" if args.rate is None else "replicas"


def _per_seed(init: tuple, fn, calls: list[tuple], jobs: int | None, unit: str,
              what: str = "") -> list[capacity.Search]:
    """fn(*call) for every call on the sweep's worker setup: here for one call, each probe said on stderr (in `unit`)
    as it is decided, else one worker process each, each search said as it ends (`what` names the searches)."""
    from servecap.traces import metrics  # noqa: F401  (imported before the workers fork, as the sweep does)
    from . import fleet, simulator  # noqa: F401
    jobs = min(jobs or os.cpu_count() or 1, len(calls))
    if jobs == 1:
        sweep._init(*init)
        return [fn(*c, on_probe=_said(what, unit)) for c in calls]
    pool = ProcessPoolExecutor(jobs, initializer=sweep._init, initargs=(*init, sweep.DEFAULT_PERCENTILES, os.getpid()))
    try:
        futures = [pool.submit(fn, *c) for c in calls]
        for f in as_completed(futures):
            print(f"  {what}seed {f.result().seed}: search done", file=sys.stderr, flush=True)
        out = [f.result() for f in futures]
    except BaseException:
        workers.stop(pool)
        raise
    pool.shutdown()
    return out


def _said(what: str, unit: str) -> capacity.OnProbe:
    def said(seed: int, value: float, held: bool) -> None:
        name = "replica" if unit == "replicas" and value == 1 else unit
        print(f"  {what}seed {seed}: {value:.4g} {name} {'holds' if held else 'fails'}", file=sys.stderr, flush=True)
    return said


def _windows(args: argparse.Namespace, table, config: ServingConfig, trace) -> list[dict]:
    parts = capacity.windows(trace, args.window_s)
    end = max(r.arrival for r in trace.requests)
    said = []
    for start, part in parts:
        rate = part.offered_rate
        if rate is None:
            print(f"window {start:g}-{start + args.window_s:g} s: {len(part)} request, no rate: not searched")
            continue
        sweep._init(table, args.strict, Workload(len(part), 0, part), args.noise_seed, args.slo)
        f = capacity.fewest_replicas(config, rate, 0, args.slo, args.max_replicas, args.router)
        print(f"window {start:g}-{start + args.window_s:g} s: {len(part)} requests at {rate:.4g} req/s -> "
              f"{_replicas(f.answer, args.max_replicas)}")
        said.append({"start_s": start, "seconds": min(args.window_s, end - start),  # the last ends with the trace
                     "requests": len(part), "rate": rate, "replicas": f.answer, "probes": _probes(f)})
    found = [w["replicas"] for w in said if w["replicas"] is not None]
    if found:
        print(f"fewest replicas over {len(said)} windows: min {min(found)}, max {max(found)} (provision the max "
              f"for the whole trace, or follow the windows)")
    if found and len(found) == len(said):
        print(f"replica-hours over the trace: {sum(w['replicas'] * w['seconds'] for w in said) / 3600:.3g} following "
              f"the windows, {max(found) * (end - trace.requests[0].arrival) / 3600:.3g} at the max throughout")
    return said
