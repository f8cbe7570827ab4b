"""`python -m engine`: run traces on the real engine, or run the parity gate."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from costs.shapes import BACKENDS
from traces.cli import SLO_HELP, slo_arg, workload_from_args, workload_options
from traces.errors import InputError
from traces.model_spec import MODELS


def engine_options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("engine")
    g.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-1.5b",
                   help="model configuration (tiny: a 2-layer Qwen2 for CPU demos and tests)")
    g.add_argument("--checkpoint", metavar="DIR", help="local HF checkpoint directory (default: seeded random weights)")
    g.add_argument("--weights-seed", type=int, default=0, help="seed of the random weights (default 0)")
    g.add_argument("--device", default="cuda", help="cuda (default) or cpu (Triton interpreter: tiny model only)")
    g.add_argument("--dtype", default=None, help="float16 on a GPU, float32 on the CPU (default)")
    g.add_argument("--max-batch", type=int, default=32, help="batch rows (default 32)")
    g.add_argument("--pool-gib", type=float, help="KV pool size in GiB (default: sized from free GPU memory)")
    g.add_argument("--pool-blocks", type=int, help="KV pool size in blocks")
    g.add_argument("--block-size", type=int, default=64, help="tokens per KV block (default 64)")
    g.add_argument("--max-prompt", type=int, default=None, help="longest prompt (default 4096; 96 for --model tiny)")
    g.add_argument("--max-budget", type=int, default=None, help="largest token budget (default 256; 32 for tiny)")
    g.add_argument("--backends", default=",".join(BACKENDS), help="decode backends to compile (default paged,padded)")
    g.add_argument("--expect-gpu", metavar="NAME", help="refuse to run on any other device, e.g. 'NVIDIA H200'")
    return p


def build_engine(args: argparse.Namespace):
    from .engine import Engine, EngineConfig  # torch is imported only once a command needs the engine
    tiny = args.model == "tiny"
    backends = tuple(b for b in args.backends.split(",") if b)
    bad = [b for b in backends if b not in BACKENDS]
    if bad:
        raise InputError(f"unknown backend(s) {bad}; choose from {', '.join(BACKENDS)}")
    cfg = EngineConfig(max_batch=args.max_batch, block_size=args.block_size, pool_gib=args.pool_gib,
                       pool_blocks=args.pool_blocks, max_prompt=args.max_prompt or (96 if tiny else 4096),
                       max_budget=args.max_budget or (32 if tiny else 256), backends=backends,
                       checkpoint=args.checkpoint, seed=args.weights_seed,
                       dtype=args.dtype or ("float32" if args.device == "cpu" else "float16"), device=args.device,
                       spec=dict(MODELS[args.model]), expect_gpu=args.expect_gpu)
    return Engine(cfg)


def _run(args: argparse.Namespace) -> None:
    from traces.metrics import slo_keys, summary
    trace = workload_from_args(args)
    engine = build_engine(args)
    runs = args.warmup + args.repeat
    walls = []
    for i in range(runs):
        warm = i < args.warmup
        out = None if warm or not args.out else Path(args.out) / (f"run-{i - args.warmup + 1}" if args.repeat > 1 else "")
        rec = engine.run(trace, out, args.backend, tokens=not args.no_tokens, policy=args.prefill,
                         extra_meta={"repeat": None if warm else i - args.warmup + 1, "warmup_runs": args.warmup})
        s = summary(rec, slos=args.slo)
        if not warm:
            walls.append(s["wall_time_s"])
        keys = ("n", "served_rate", "wall_time_s", "queue_wait_p50", "ttft_p50", "tpot_p50", "decode_tok_s") + \
            tuple(k for k in slo_keys(args.slo) if k in s)
        print(("warm-up " if warm else "") + json.dumps({k: s[k] for k in keys}))
        if len(rec.rejected):
            print(f"{len(rec.rejected)} request(s) refused:", *rec.rejected.reason, sep="\n  ")
    if len(walls) > 1:
        print(f"median wall time over {len(walls)} recorded runs: {statistics.median(walls):.3f} s")
    if args.out:
        print(f"records: {args.out}")


def _gate(args: argparse.Namespace) -> int:
    from .parity import run_gate
    engine = build_engine(args)
    mismatches, compared = run_gate(engine, args.budget)
    real = [m for m in mismatches if not m.near_tie]
    for m in mismatches:
        print(f"  {m.scenario} {m.backend} request {m.request_id}: token {m.index} got {m.got} want {m.want} "
              f"(reference top-2 margin {m.margin:.4f}, engine-vs-reference logit difference {m.logit_diff:.4f}"
              f"{': near tie' if m.near_tie else ''})")
    print(f"parity gate: {compared} tokens compared, {len(mismatches)} mismatching sequence(s), "
          f"{len(mismatches) - len(real)} of them near-tie flips, {len(real)} real")
    return 1 if real else 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    r = sub.add_parser("run", parents=[workload_options(), engine_options()],
                       help="replay a trace on the engine in real time and record every request, step and token")
    r.add_argument("--backend", choices=BACKENDS, default="paged", help="decode attention (default paged)")
    r.add_argument("--prefill", default="padded", metavar="POLICY",
                   help="prefill policy: padded, packed or chunked:N (default padded)")
    r.add_argument("--out", metavar="DIR", help="write the run record here (rows appended as they complete)")
    r.add_argument("--no-tokens", action="store_true", help="do not record per-token times")
    r.add_argument("--slo", type=slo_arg, default=(), metavar="SPEC", help=SLO_HELP + " (scored as the simulator scores)")
    r.add_argument("--warmup", type=int, default=0, help="unrecorded runs first (closed controls: 2)")
    r.add_argument("--repeat", type=int, default=1, help="recorded runs (closed controls: 5); median wall time printed")
    r.set_defaults(func=_run)
    g = sub.add_parser("gate", parents=[engine_options()],
                       help="token parity against HF transformers' greedy generate, and paged against padded")
    g.add_argument("--budget", type=int, default=12, help="tokens per request (default 12)")
    g.set_defaults(func=_gate)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
