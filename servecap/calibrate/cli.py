"""`python -m calibrate --out TABLE.json`: measure the engine's step costs on this GPU and write a cost table.

Everything is checked before the engine starts: the device (there must be a GPU, and the --expect-gpu one),
the options, and a points file left by an interrupted run (it must come from the same setup; its runs are
skipped). A problem is one line on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from servecap.core.config import ServingConfig
from servecap.core.policies import PADDED, every_policy
from servecap.costs.shapes import BACKENDS, backend_from_user
from servecap.costs.table import save_cost_table
from servecap.traces.arg_types import checked
from servecap.traces.command import Parser, command
from servecap.traces.errors import InputError
from servecap.traces.model_spec import DEFAULT_MODEL, MODELS
from servecap.traces.outpath import check_out_file, refuse_special

from .accuracy import report
from .from_runs import HOLDOUTS
from .measure import STATIONARY_SETTLE_S
from .plan import FULL, FULL_LENGTH, H200_SPEEDS, LONG, QUICK, describe, make_plan, max_rows, run_plan
from .store import PointsFile, points_path


def _backends(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(backend_from_user(t.strip(), "calibrate") for t in text.split(",") if t.strip()))
    bad = [n for n in names if n not in BACKENDS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of backends ({', '.join(BACKENDS)})")
    return names


_seconds = checked(float, lambda v: 0 <= v <= 10, "a number of seconds from 0 to 10")


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return int(text)


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m calibrate", description=(
        "Measure the serving engine's step costs on this GPU (closed runs timed by the engine's own step log: a "
        "prefill grid of group width x padded length, decode steps for every row count at several K/V lengths "
        "per backend, and retirement's overhead), fit the cost model, check it on held-out shapes, and write the "
        "cost table the simulator reads. Measured runs are kept in OUT.points.jsonl as they finish; re-running "
        "the same command resumes. No GPU here? `modal run servecap/calibrate/modal_app.py` calibrates on Modal's A10."))
    p.add_argument("--out", type=Path, help="the cost table to write (JSON); required but with --check-stationary")
    p.add_argument("--check-stationary", action="store_true",
                   help="only the stationarity check: shapes this engine has never run, each timed on its first run "
                        "and on repeats; exit status 1 if a step's cost depended on what ran before (p95 of first / "
                        "repeat above the limit). Writes nothing")
    p.add_argument("--settle-s", type=_seconds, default=STATIONARY_SETTLE_S, metavar="S",
                   help="idle seconds before each repetition of a stationarity run, so that first runs and repeats "
                        "start from the same GPU state (default %(default)s; 0 runs them back to back, as before)")
    p.add_argument("--refresh", type=Path, metavar="TABLE",
                   help="instead of a whole calibration, re-measure a few of TABLE's shapes on this GPU and write TABLE "
                        "rescaled to it (about a minute): for a GPU instance other than the one that made TABLE")
    p.add_argument("--serving-probe", action="store_true",
                   help="with --refresh: read this GPU's speed from a short serving run per prefill policy near the "
                        "capacity TABLE predicts (about a minute) instead of closed shapes, and rescale TABLE per kind "
                        "to what those runs paid, its serving correction kept (servecap/calibrate/speed.py)")
    p.add_argument("--probe-trace", type=Path, nargs="+", metavar="CSV",
                   help="with --serving-probe: serve the first requests of these traces (traffic like yours, a window "
                        "of its own) instead of the serving phase's synthetic one, each with every policy")
    p.add_argument("--refit", type=Path, metavar="TABLE",
                   help="no GPU: rebuild TABLE from its measured runs (TABLE.points.jsonl, or --points) with this "
                        "version's cost model, into --out")
    p.add_argument("--points", type=Path, metavar="FILE", help="with --refit: the points file of TABLE")
    p.add_argument("--from-runs", type=Path, nargs="+", metavar="RUN_DIR",
                   help="no GPU: correct --table for serving from the steps of these real run records (directories "
                        "searched for them), held out by run, into --out (servecap/calibrate/from_runs.py)")
    p.add_argument("--table", type=Path, metavar="TABLE", help="with --from-runs: the cost table to correct")
    p.add_argument("--rescale", action="store_true",
                   help="with --from-runs: keep --table's correction and only rescale its step costs per kind "
                        "(prefill; decode per backend) to these runs' summed time over its price: a GPU instance's "
                        "serving speed, from a few of its runs (servecap/calibrate/speed.py; --holdout does not apply)")
    p.add_argument("--median-gpu", action="store_true",
                   help="with --rescale: each kind's factor the median over the runs' GPUs (three or more) of each "
                        "GPU's own, not the runs pooled: a typical GPU's speed, for planning one not yet seen")
    p.add_argument("--holdout", choices=HOLDOUTS, default="run",
                   help="with --from-runs: grade the correction on every third run of each policy, left out of the "
                        "fit (run, the default), or on every point (a trace on one configuration, its repeats "
                        "together) priced by the correction fitted on the other points, the table's correction "
                        "fitted on all (point: for runs with repeats, which would otherwise sit on both sides), or "
                        "on every GPU's runs so (gpu: as on a GPU the correction never saw)")
    p.add_argument("--serving", type=Path, metavar="TABLE2",
                   help="after the closed runs, a serving phase: seeded arrival traces on the same engine, each "
                        "prefill policy below, near and past the capacity the new table predicts for it, and the "
                        "table corrected from their steps (as --from-runs, held out by run) written to TABLE2; the "
                        "runs' records go to TABLE2.runs/ (servecap/calibrate/serving.py)")
    p.add_argument("--force", action="store_true", help="replace an existing --out table")
    p.add_argument("--expect-gpu", metavar="NAME",
                   help="refuse to run unless the GPU is this one (e.g. 'NVIDIA H200'; 'A10' does not match 'A10G')")
    p.add_argument("--backend", type=_backends, default=BACKENDS, metavar="B1,B2",
                   help=f"decode backends to measure (default {','.join(BACKENDS)})")
    p.add_argument("--max-batch", "--max-num-seqs", type=_count, default=32,
                   help="batch rows (vLLM's max_num_seqs) (default %(default)s)")
    p.add_argument("--checkpoint", metavar="DIR", help="a local checkpoint directory (default: seeded random weights; "
                                                       "costs depend on the shapes, not the weights' values)")
    p.add_argument("--model", choices=sorted(MODELS), default=DEFAULT_MODEL, help="model shapes (default %(default)s)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default), or cpu: Triton's interpreter, for trying the path with --model tiny --quick")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help=(
        f"a smoke test of the whole path: at most {QUICK.max_rows} rows, prompts up to {QUICK.max_prompt} tokens, "
        "a handful of shapes; its table is not for simulation"))
    size.add_argument("--long", action="store_true", help=(
        f"full length: prompts to {LONG.max_prompt} tokens and decode contexts to the model's positions, at up to "
        f"{LONG.max_rows} rows (a table for long-context traces)"))
    size.add_argument("--full-length", action="store_true", help=(
        f"the full grid at {FULL.max_prompt} tokens and full length to {FULL_LENGTH.max_prompt} in one table, the "
        f"engine capped at {FULL_LENGTH.max_step_tokens} tokens a prefill step (serve with "
        f"--max-num-batched-tokens {FULL_LENGTH.max_step_tokens}): a 32-row table for long-context traces"))
    return p


def calibrate(args: argparse.Namespace, argv: list[str]) -> int:
    if args.out is not None:
        check_out_file(args.out)  # a table that cannot be written would throw the whole calibration away
        refuse_special(args.out)  # nor would --force let it replace a symlink or a device
    if args.median_gpu and not args.rescale:
        raise InputError("--median-gpu goes with --from-runs RUNS --table T --rescale")
    if args.refit is not None:
        if args.out is None or (args.out.exists() and not args.force):
            raise InputError("--refit needs --out NEW.json (a new file, or --force)")
        from .refit import refit
        print(f"refitted {args.refit} into {args.out}: cost table {refit(args.refit, args.out, args.points, argv)}")
        return 0
    if args.from_runs is not None:
        if args.table is None or args.out is None:
            raise InputError("--from-runs needs --table TABLE (to correct) and --out NEW.json")
        if args.rescale:
            from . import speed
            tid, measured = speed.rescale_from_runs(args.from_runs, args.table, args.out, argv, args.force,
                                                    median_gpu=args.median_gpu)
            print(speed.describe(measured))
            print(f"wrote cost table {tid} to {args.out} (rescaled from {args.table})")
            return 0
        from . import from_runs
        tid, held_out = from_runs.from_runs(args.from_runs, args.table, args.out, argv, args.force,
                                            holdout=args.holdout)
        print(from_runs.describe(held_out))
        print(f"wrote cost table {tid} to {args.out} (corrected from {args.table})")
        return 0
    if args.rescale:
        raise InputError("--rescale goes with --from-runs (a table rescaled to those runs' speed)")
    if args.serving_probe and args.refresh is None:
        raise InputError("--serving-probe goes with --refresh TABLE (the table to rescale to this GPU)")
    if args.probe_trace and not args.serving_probe:
        raise InputError("--probe-trace goes with --refresh TABLE --serving-probe (the traces the probe serves)")
    names = [t.stem for t in args.probe_trace or []]
    if len(set(names)) < len(names):
        raise InputError(f"--probe-trace names two traces alike ({', '.join(names)}): their runs would share a folder")
    from servecap.engine.engine import Engine, EngineConfig  # torch: only once the options are known to be good

    from .measure import identity, measure, telemetry, telemetry_path
    from .table import build_table

    t0 = time.perf_counter()
    if args.check_stationary:
        pass  # writes nothing
    elif args.out is None:
        raise InputError("--out TABLE.json is required (the cost table to write), except with --check-stationary")
    elif args.out.exists() and not args.force:
        raise InputError("already exists; pass --force to replace it", path=args.out)
    if args.serving is not None:
        if args.out is None or args.check_stationary or args.refresh is not None:
            raise InputError("--serving follows a calibration: give it with --out (not --check-stationary or --refresh)")
        check_out_file(args.serving)
        refuse_special(args.serving)
        if args.serving.exists() and not args.force:
            raise InputError("already exists; pass --force to replace it", path=args.serving)
    plan = QUICK if args.quick else LONG if args.long else FULL_LENGTH if args.full_length else FULL
    serving = ServingConfig(model=args.model, dtype="float16" if args.device == "cuda" else "float32",
                            max_batch=max_rows(plan, args.max_batch), max_num_batched_tokens=plan.max_step_tokens)
    cfg = EngineConfig(serving, max_prompt=plan.max_prompt, max_budget=plan.max_budget, backends=args.backend,
                       checkpoint=args.checkpoint, device=args.device, expect_gpu=args.expect_gpu)
    if args.refresh is not None:
        from .refresh import refresh, source_table
        source = source_table(args.refresh, cfg)
    ident = identity(cfg)  # refuses a missing or unexpected GPU before anything is written
    if args.refresh is not None:
        with telemetry(telemetry_path(args.out), ident) as rec:
            if args.serving_probe:
                from .serving import QUICK_REQUESTS, REQUESTS
                from .speed import serving_probe
                return serving_probe(args.refresh, args.out, cfg, [str(p) for p in every_policy(plan.chunk)],
                                     args.backend[0], argv, QUICK_REQUESTS if plan is QUICK else REQUESTS, rec,
                                     {t.stem: t for t in args.probe_trace or []})
            return refresh(source, args.out, cfg, argv, rec)
    if args.check_stationary:
        with tempfile.TemporaryDirectory(prefix="stationarity-") as tmp, \
                telemetry(Path(tmp) / "telemetry.csv", ident) as rec:
            return check_stationary(plan, cfg, args.backend, args.settle_s, rec)
    runs = make_plan(plan, serving.max_batch, args.backend, tuple(map(str, every_policy(plan.chunk))))
    store = PointsFile(points_path(args.out), ident)
    todo = sum(r.key not in store for r in runs)
    print(f"calibrating {ident['model']} ({ident['dtype']}) on {ident['device']}: max batch {serving.max_batch}, "
          f"prompts up to {cfg.max_prompt}, budget up to {cfg.max_budget}, {serving.block_size}-token blocks, "
          f"backends {', '.join(args.backend)}")
    print(describe(runs, H200_SPEEDS if args.model == DEFAULT_MODEL and not args.quick else None))
    if todo < len(runs):
        print(f"resuming: {len(runs) - todo} of {len(runs)} runs already measured in {store.path}")
    rec = telemetry(telemetry_path(args.out), ident)
    try:
        with rec:
            engine = Engine(cfg)
            with tqdm(total=len(runs), unit="run", desc="calibrating", dynamic_ncols=True) as bar:
                def advance(run):
                    bar.set_postfix_str(run.label, refresh=False)
                    bar.update()
                made = run_plan(runs, store.__contains__, lambda r: measure(engine, r, args.settle_s), store.add,
                                advance)
    except KeyboardInterrupt:
        print(f"\ninterrupted: the runs measured so far are kept in {store.path}; run the same command to resume",
              file=sys.stderr)
        return 130
    finally:
        store.close()
    calibration = {"wall_s": round(time.perf_counter() - t0, 1), "engine_start_s": round(engine.start_s, 1),
                   "runs_measured_now": made, "runs_resumed": len(runs) - made, "points_file": str(store.path),
                   "backends": list(args.backend), "command": shlex.join(["python", "-m", "calibrate", *argv]),
                   "telemetry": rec.summary()}
    try:
        table = build_table(plan, runs, store.samples, engine.metadata(), calibration)
    except InputError as e:  # a re-run would fit the same kept runs and fail the same way
        raise InputError(f"{e}; fitted from the {len(runs)} runs kept in {store.path}: delete that file to measure "
                         f"them anew (a re-run, even with --force, refits them)") from None
    table_id = save_cost_table(table, args.out)
    print(report(table["accuracy"]))
    st = table["stationarity"]
    o = table["overhead"]
    print(f"overhead: retirement {o['retire_s'] * 1e6:.0f} us per retired row (p10 {o['retire_p10_s'] * 1e6:.0f}, "
          f"p90 {o['retire_p90_s'] * 1e6:.0f}, n {o['retire_n']})")
    print(f"wrote cost table {table_id} to {args.out} ({len(table['prefill']['points'])} prefill points, "
          + ", ".join(f"{len(d['points'])} {b} decode points" for b, d in table["decode"].items())
          + f"; {calibration['wall_s'] / 60:.1f} min)")
    print(stationarity_line(st))
    if args.serving is not None:
        serving_phase(engine, plan, args, argv)
    if not st["passed"]:
        print(f"calibrate: error: the stationarity check failed (p95 of first-run / repeat above {st['limit']}): a step's "
              f"cost depended on what ran before it. The table is written but refused by the simulator unless "
              f"--allow-nonstationary is given", file=sys.stderr)
        return 1
    return 0


def serving_phase(engine, plan, args: argparse.Namespace, argv: list[str]) -> None:
    """Serve the phase's traces on the calibrated engine and write the table they correct (servecap/calibrate/serving.py)."""
    from . import from_runs
    from .serving import QUICK_REQUESTS, REQUESTS, serve_runs, serving_runs

    backend = args.backend[0]
    runs = serving_runs(args.out, [str(p) for p in every_policy(plan.chunk)], backend, engine.cfg,
                        QUICK_REQUESTS if plan is QUICK else REQUESTS)
    folder = args.serving.with_name(args.serving.name + ".runs")
    with tqdm(total=len(runs), unit="run", desc="serving phase", dynamic_ncols=True) as bar:
        dirs = serve_runs(engine, runs, folder, backend, lambda run: (bar.set_postfix_str(run.name, refresh=False),
                                                                     bar.update()))
    tid, report = from_runs.from_runs(dirs, args.out, args.serving, argv, force=True)
    print(from_runs.describe(report))
    print(f"wrote cost table {tid} to {args.serving} (corrected from {args.out} by the serving phase's {len(dirs)} runs "
          f"in {folder})")


def check_stationary(plan, cfg, backends, settle_s: float, rec) -> int:
    """The stationarity check alone, on a freshly started engine; what the GPU's clock did is printed (`rec`)."""
    from servecap.engine.engine import Engine

    from .measure import measure
    from .plan import stationarity_runs
    from .table import stationarity

    engine = Engine(cfg)
    others = [str(p) for p in every_policy(plan.chunk) if p != PADDED]
    runs = stationarity_runs(plan, cfg.serving.max_batch, backends, others)
    samples = {r.key: measure(engine, r, settle_s) for r in tqdm(runs, unit="run", desc="stationarity")}
    st = stationarity(runs, samples)
    print(f"engine start {engine.start_s:.1f} s; {settle_s} s idle before each repetition; every shape in run order "
          "(first / repeat; SM clock in MHz before and after each repetition):")
    for s in st["shapes"]:
        print(f"  {s['run']:<44} {s['first_over_again']:.3f}  {s.get('sm_clock_mhz')}")
    print(stationarity_line(st))
    print(f"GPU telemetry: {json.dumps(rec.summary())}")
    return 0 if st["passed"] else 1


def stationarity_line(st: dict) -> str:
    return ("stationarity (first run of a never-run shape / its repeats): " + "; ".join(
        f"{k} n={st[k]['n']} median {st[k]['median']:.3f} p95 {st[k]['p95']:.3f} max {st[k]['max']:.3f}"
        for k in ("prefill", "decode")) + f"; limit {st['limit']} on the p95: {'passed' if st['passed'] else 'FAILED'}")


@command("calibrate")
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    return calibrate(parser().parse_args(argv), argv)


if __name__ == "__main__":
    sys.exit(main())
