"""`python -m engine`: run traces on the real engine, or run the parity gate.

Every option, the workload and --out are checked before the model loads (minutes on a GPU, longer on the CPU):
a problem is one line on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

from servecap.core.block_pool import PoolSize, blocks_for_gib
from servecap.core.config import ServingConfig
from servecap.core.options import PREFILL_HELP, add_scheduler_options, policy_arg
from servecap.costs.shapes import BACKENDS, backend_from_user
from servecap.traces.arg_types import SLO_HELP, batch_arg, blocks_arg, checked, count_arg, gib_arg, seed_arg, slo_arg
from servecap.traces.arrival_options import add_workload_options
from servecap.traces.command import Parser, command
from servecap.traces.errors import InputError
from servecap.traces.formatting import fmt_ms
from servecap.traces.latency import DEFAULT_PERCENTILES, PERCENTILES_HELP, latency_ms, latency_table, percentiles_arg
from servecap.traces.memory import GIB, check_fits
from servecap.traces.model_spec import DEFAULT_MODEL, DTYPE_BYTES, MODELS, kv_bytes_per_token, parameter_count
from servecap.traces.outpath import check_out_dir, check_trace_events
from servecap.traces.prompts import PROMPT_LENGTHS, PROMPT_NAMES
from servecap.traces.records import TABLES
from servecap.traces.trace_io import requested_trace
from servecap.traces.workload import BUDGETS, DEFAULT_BUDGET, Trace

DTYPES = ("float16", "bfloat16", "float32")
DEFAULTS = {"tiny": {"max_prompt": 96, "max_budget": 32}, None: {"max_prompt": 4096, "max_budget": 256}}
_device = checked(str, lambda v: re.fullmatch(r"cpu|cuda(:\d+)?", v) is not None, "a device: cuda, cuda:N or cpu")
# The kernels tile a block with tl.arange, which takes only powers of two.
_block_size = checked(int, lambda v: v >= 1 and v & (v - 1) == 0, "a power of two (16, 32, 64, ...)")


def engine_options() -> argparse.ArgumentParser:
    p = Parser(add_help=False)
    g = p.add_argument_group("engine")
    g.add_argument("--model", choices=sorted(MODELS), default=DEFAULT_MODEL,
                   help="model configuration (tiny: a 2-layer Qwen2 for CPU demos and tests)")
    g.add_argument("--checkpoint", metavar="DIR", help="local HF checkpoint directory (default: seeded random weights)")
    g.add_argument("--weights-seed", type=seed_arg, default=0, help="seed of the random weights (default 0)")
    g.add_argument("--device", type=_device, default="cuda",
                   help="cuda (default), cuda:N or cpu (Triton interpreter: tiny model only)")
    g.add_argument("--dtype", choices=DTYPES, default=None, help="float16 on a GPU, float32 on the CPU (default)")
    g.add_argument("--max-batch", "--max-num-seqs", type=batch_arg, default=32,
                   help="batch rows (vLLM's max_num_seqs) (default 32)")
    pool = g.add_mutually_exclusive_group()
    pool.add_argument("--pool-gib", type=gib_arg, help="KV pool size in GiB (default: sized from free GPU memory)")
    pool.add_argument("--pool-blocks", type=blocks_arg, help="KV pool size in blocks")
    g.add_argument("--block-size", type=_block_size, default=64, help="tokens per KV block (default 64)")
    g.add_argument("--max-prompt", type=count_arg, default=None, help="longest prompt (default 4096; 96 for --model tiny)")
    g.add_argument("--max-budget", type=count_arg, default=None, help="largest token budget (default 256; 32 for tiny)")
    g.add_argument("--backends", default=",".join(BACKENDS),
                   help="decode backends to compile (default paged,dense; padded is the old name of dense)")
    g.add_argument("--expect-gpu", metavar="NAME", help="refuse to run on any other device, e.g. 'NVIDIA H200'")
    return p


def workload_options() -> argparse.ArgumentParser:
    """The options that pick one run's workload, as `sim run` takes them, and --budget for a closed uniform run."""
    p = Parser(add_help=False)
    add_workload_options(p).add_argument("--budget", type=count_arg, default=DEFAULT_BUDGET,
                                         help=f"tokens per request for --closed-uniform (default {DEFAULT_BUDGET})")
    return p


def workload_from_args(args: argparse.Namespace) -> Trace:
    return requested_trace(rate=args.rate, n=args.n, seed=args.seed, trace_file=args.trace,
                           closed_mixed_n=args.closed_mixed, closed_uniform_prompt=args.closed_uniform,
                           budget=args.budget, burstiness=args.burstiness, ramp_up_s=args.ramp_up_s)


def check_options(args: argparse.Namespace) -> None:
    """Fill in the model's defaults and refuse what the engine could not run, before anything loads."""
    defaults = DEFAULTS.get(args.model, DEFAULTS[None])
    args.max_prompt = args.max_prompt or defaults["max_prompt"]
    args.max_budget = args.max_budget or defaults["max_budget"]
    positions = MODELS[args.model]["max_position_embeddings"]
    if args.max_prompt + args.max_budget > positions:
        raise InputError(f"--max-prompt {args.max_prompt} + --max-budget {args.max_budget} is beyond --model "
                         f"{args.model}'s {positions} positions")
    backends = tuple(backend_from_user(b, "engine") for b in args.backends.split(",") if b)
    bad = [b for b in backends if b not in BACKENDS]
    if bad or not backends:
        raise InputError(f"--backends {args.backends!r}: choose from {', '.join(BACKENDS)}")
    args.backends = ",".join(backends)
    if args.device == "cpu":
        check_cpu_memory(args)


def check_cpu_memory(args: argparse.Namespace) -> None:
    """On the CPU (Triton's interpreter) only the tiny model runs, and the weights and an explicit pool must fit in
    this machine's memory: refused here, before the model loads, rather than as an allocation failure."""
    spec = MODELS[args.model]
    dtype = args.dtype or "float32"  # the CPU's default
    weights = parameter_count(spec) * DTYPE_BYTES[dtype]
    if args.model != "tiny":
        raise InputError(f"--device cpu runs --model tiny only: --model {args.model} would need "
                         f"{weights / GIB:.1f} GiB for its weights alone, and minutes a step under Triton's "
                         f"interpreter; run it on a GPU")
    kv_bytes = kv_bytes_per_token(spec, dtype)
    block_bytes = args.block_size * kv_bytes
    blocks = args.pool_blocks or (args.pool_gib and blocks_for_gib(args.pool_gib, args.block_size, kv_bytes))
    if blocks:
        check_fits(weights + (blocks + 1) * block_bytes, f"a KV pool of {blocks:,} blocks",
                   "choose a smaller --pool-gib or --pool-blocks")


_ALLOCATION = re.compile(r"can't allocate memory|out of memory|size calculation overflow|tried to allocate", re.I)


def build_engine(args: argparse.Namespace):
    """The engine, or an InputError when sizes within the options' ranges do not fit this machine's memory."""
    try:
        return _build_engine(args)
    except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        if not (isinstance(e, MemoryError) or _ALLOCATION.search(str(e))):
            raise
        asked = re.search(r"allocate (\d+) bytes", str(e))
        size = f" (one buffer of {int(asked[1]) / GIB:,.1f} GiB)" if asked else ""
        pool = f"--pool-blocks {args.pool_blocks}" if args.pool_blocks else \
            f"--pool-gib {args.pool_gib:g}" if args.pool_gib else "the default pool"
        where = "the host's memory" if args.device == "cpu" else f"{args.device}'s memory"
        raise InputError(f"the engine does not fit in {where} with --max-batch {args.max_batch} and "
                         f"{pool}{size}; choose smaller sizes") from None


def check_workload(trace: Trace, args: argparse.Namespace) -> None:
    """Refuse a workload with a request the engine would refuse (it records such a request as rejected and
    serves the rest, which on a whole-workload mismatch is a run of nothing), naming the first one."""
    from servecap.core.block_pool import largest_request_tokens, unbounded_pool

    if not trace.requests:
        raise InputError("the workload has no requests")
    trace.check_arrivals()
    misfit = (f"the workload does not fit the engine (--model {args.model}, --max-prompt {args.max_prompt}, "
              f"--max-budget {args.max_budget})")
    # Each limit on its own: the engine sizes its prefill buckets by --max-prompt, and only the sum reaches the
    # scheduler, which would serve a 100-token prompt under --max-prompt 96 with a short budget.
    for req in trace.requests:
        for what, value, option, limit in (("prompt", req.prompt_tokens, "--max-prompt", args.max_prompt),
                                           ("budget", req.budget, "--max-budget", args.max_budget)):
            if value > limit:
                fix = ""
                if args.closed_uniform is not None and what == "budget":
                    fix = f"; give --budget {limit} or less"
                elif args.trace is None and args.closed_uniform is None:
                    fix = (f"; the seeded mixed draw (--rate, --closed-mixed) runs prompts to "
                           f"{max(PROMPT_LENGTHS.values())} tokens and budgets to {max(BUDGETS)}: give a trace whose "
                           f"requests fit (the traces importers take --max-prompt and --max-budget) or "
                           f"--closed-uniform {PROMPT_NAMES[0]} --budget {args.max_budget}")
                raise InputError(f"{misfit}: request {req.request_id}: {what} of {value} tokens is beyond {option} "
                                 f"{limit}{fix}")
    pool = unbounded_pool(1, largest_request_tokens(trace.requests), args.block_size)
    sched = ServingConfig(block_size=args.block_size, max_batch=args.max_batch, prefill=args.prefill,
                          admission=args.admission, max_num_batched_tokens=args.max_num_batched_tokens
                          ).scheduler(pool, args.max_prompt + args.max_budget, max_batch=1)
    try:
        for req in trace.requests:
            sched.submit(req)
    except InputError as e:
        raise InputError(f"{misfit}: {e}") from None


def _build_engine(args: argparse.Namespace):
    from .engine import Engine, EngineConfig  # torch is imported only once a command needs the engine
    serving = ServingConfig(model=args.model, dtype=args.dtype or ("float32" if args.device == "cpu" else "float16"),
                            block_size=args.block_size, max_batch=args.max_batch,
                            pool=PoolSize(args.pool_gib, args.pool_blocks),
                            max_num_batched_tokens=args.max_num_batched_tokens)
    cfg = EngineConfig(serving, max_prompt=args.max_prompt, max_budget=args.max_budget,
                       backends=tuple(args.backends.split(",")), checkpoint=args.checkpoint, seed=args.weights_seed,
                       device=args.device, expect_gpu=args.expect_gpu)
    return Engine(cfg)


def _out_dirs(args: argparse.Namespace) -> list[Path]:
    """Where each recorded run goes: --out itself, or run-1, run-2, ... under it with --repeat above 1."""
    if not args.out:
        return []
    out = Path(args.out)
    return [out / f"run-{i}" for i in range(1, args.repeat + 1)] if args.repeat > 1 else [out]


def _run(args: argparse.Namespace) -> int:
    from servecap.traces.importers import import_note
    from servecap.traces.metrics import stability_said, summary
    from servecap.traces.slo import slo_line
    from servecap.traces.timeline import write_timeline

    from servecap.core.policies import PrefillPolicy
    check_options(args)
    PrefillPolicy.parse(args.prefill)
    outs = _out_dirs(args)
    for out in outs:
        check_out_dir(out)
        if any((out / f"{t}.csv").exists() for t in TABLES):
            raise InputError("already holds a run record; choose a new output directory", path=out)
    check_trace_events(args.trace_events, args.force, {"the input trace (--trace)": args.trace,
                                                       "the checkpoint (--checkpoint)": args.checkpoint,
                                                       **{f"the run record {o}": o for o in outs}})
    if args.save_result:
        from servecap.traces.bench_result import check_result_path
        check_result_path(args.save_result)
    trace = workload_from_args(args)
    check_workload(trace, args)
    note = import_note(trace.meta)
    if note:  # what the trace's import dropped or clipped, before the run, as `sim run` says it
        print(f"import   {note}")
    engine = build_engine(args)
    runs = args.warmup + args.repeat
    walls = []
    for i in range(runs):
        warm = i < args.warmup
        out = None if warm or not outs else outs[i - args.warmup]
        try:
            rec = engine.run(trace, out, args.backend, tokens=not args.no_tokens, policy=args.prefill,
                             admission=args.admission, prefix_cache=args.prefix_cache,
                             extra_meta={"repeat": None if warm else i - args.warmup + 1, "warmup_runs": args.warmup})
        except KeyboardInterrupt:
            kept = f"; its completed rows are kept in {out} (meta.json says status running)" if out else ""
            print(f"\nengine: interrupted during {'warm-up ' if warm else ''}run {i + 1} of {runs}{kept}",
                  file=sys.stderr)
            return 130
        s = summary(rec, slos=args.slo)
        if not warm:
            walls.append(s["wall_time_s"])
            recorded, scores = rec, s
        which = f"warm-up {i + 1} of {args.warmup}" if warm else f"run {i - args.warmup + 1} of {args.repeat}"
        print(f"{which}: {s['n']} requests in {s['wall_time_s']:.3f} s ({s['served_rate']:.2f} req/s), TTFT p50 "
              f"{fmt_ms(s['ttft_p50'] * 1e3)} ms, TPOT p50 {fmt_ms(s['tpot_p50'] * 1e3)} ms, decode "
              f"{s['decode_tok_s']:,.0f} tok/s")
        if len(rec.rejected):
            print(f"{len(rec.rejected)} request(s) refused:", *rec.rejected.reason, sep="\n  ")
    if len(walls) > 1:
        print(f"median wall time over {len(walls)} recorded runs: {statistics.median(walls):.3f} s")
    if "stable" in scores:  # a run at a rate: the simulator's verdict, by the one metrics module
        print(f"served {scores['served_rate']:.2f} req/s against {scores['expected_rate']:.2f} offered: "
              f"{stability_said(scores)}")
    print(("latency of the last run" if len(walls) > 1 else "latency") + "\n" +
          latency_table(latency_ms(recorded, args.percentiles), args.percentiles))
    if args.slo:
        print(slo_line(scores, args.slo))
    if args.out:
        print(f"records: {args.out}")
    if args.trace_events:  # the last recorded run
        print(f"timeline: {write_timeline([recorded], args.trace_events)}")
    if args.save_result:
        from servecap.traces.bench_result import bench_result, write_result
        doc = bench_result(recorded, scores, backend="servecap-engine",
                           percentiles=args.percentiles, slos=args.slo,
                           provenance={"trace_id": trace.trace_id, "trace": trace.meta,
                                       "git_commit": recorded.meta.get("git_commit"), "run": recorded.meta})
        print(f"result: {write_result(args.save_result, doc)}")
    return 0


def _gate(args: argparse.Namespace) -> int:
    from .parity import run_gate
    check_options(args)
    engine = build_engine(args)
    mismatches, compared = run_gate(engine, args.budget)
    real = [m for m in mismatches if not m.near_tie]
    for m in mismatches:
        print(f"  {m.scenario} {m.backend} request {m.request_id}: token {m.index} got {m.got} want {m.want} "
              f"(reference top-2 margin {m.margin:.4f}, rounding bound {m.bound:.4f}, engine-vs-reference logit "
              f"difference {m.logit_diff:.4f}"
              f"{': near tie' if m.near_tie else ''})")
    print(f"parity gate: {compared} tokens compared, {len(mismatches)} mismatching sequence(s), "
          f"{len(mismatches) - len(real)} of them near-tie flips, {len(real)} real")
    return 1 if real else 0


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m engine", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    r = sub.add_parser("run", parents=[workload_options(), engine_options()],
                       help="replay a trace on the engine in real time and record every request, step and token")
    r.add_argument("--backend", type=lambda v: backend_from_user(v, "engine"), choices=BACKENDS, default="paged",
                   help="decode attention (default paged)")
    r.add_argument("--prefill", type=policy_arg, default="padded", metavar="POLICY",
                   help=PREFILL_HELP + " (default padded)")
    add_scheduler_options(r)
    r.add_argument("--out", metavar="DIR", help="write the run record here (rows appended as they complete)")
    r.add_argument("--no-tokens", action="store_true", help="do not record per-token times")
    r.add_argument("--trace-events", metavar="FILE",
                   help="write the last recorded run as Chrome trace-event JSON for ui.perfetto.dev")
    r.add_argument("--force", action="store_true", help="replace an existing --trace-events FILE")
    r.add_argument("--save-result", type=Path, metavar="FILE.json",
                   help="also write the last recorded run's figures as one flat JSON object under vllm bench serve's "
                        "keys (request_throughput, p99_ttft_ms, mean_itl_ms, ...; servecap/traces/bench_result.py), with the "
                        "run's provenance, as `sim run --save-result` writes the simulator's")
    r.add_argument("--percentiles", type=percentiles_arg, default=DEFAULT_PERCENTILES, metavar="P1,P2,...",
                   help=PERCENTILES_HELP)
    r.add_argument("--slo", type=slo_arg, default=(), metavar="SPEC",
                   help=SLO_HELP + " (scored as the simulator scores)")
    r.add_argument("--warmup", type=seed_arg, default=0, help="unrecorded runs first (closed controls: 2)")
    r.add_argument("--repeat", type=count_arg, default=1,
                   help="recorded runs (closed controls: 5); median wall time printed")
    r.set_defaults(func=_run)
    g = sub.add_parser("gate", parents=[engine_options()],
                       help="token parity against HF transformers' greedy generate, and paged against padded")
    g.add_argument("--budget", type=count_arg, default=12, help="tokens per request (default 12)")
    g.set_defaults(func=_gate, max_num_batched_tokens=None)  # the gate's steps are its own
    return p


@command("engine")
def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:  # while loading: nothing was recorded yet (a run says itself what it kept)
        print("\nengine: interrupted", file=sys.stderr)
        return 130
