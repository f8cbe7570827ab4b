"""`python -m validate plan|real|report`: grade the simulator against the real engine, blind.

plan (CPU) chooses the points from the simulator's sweeps of a frozen cost table and writes each point's prediction
into plan.json; real (GPU) runs them on the engine and writes one run record per point and repeat under real/;
report (CPU) puts the plan's predictions beside the measured runs and writes report.md, points.csv and a figure;
replay (CPU) runs each real run's recorded step times through the simulator's scheduler, to show that what a
prediction misses is the step costs and not the scheduling.
Nothing already written is replaced unless --force says so; a problem is one line on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from servecap.core.options import step_cap_arg
from servecap.traces.arg_types import count_arg, level_arg, seconds_arg, seed_arg
from servecap.traces.command import Parser, command
from servecap.traces.errors import InputError
from servecap.traces.outpath import check_out_dir

# "public-below": the public traces' below-capacity points (the rest of the group stays)
GROUPS = ("curve", "closed", "public", "public-below", "policies", "fleet")
GRADED_TABLE = "the plan's cost table (default: the one its plan.json names, where that file is here)"


def _shard(text: str) -> tuple[int, int]:
    i, _, n = text.partition("/")
    if not (i.isdigit() and n.isdigit() and 1 <= int(i) <= int(n)):
        raise argparse.ArgumentTypeError(f"{text!r} is not I/N with 1 <= I <= N")
    return int(i) - 1, int(n)


def _skip(text: str) -> tuple[str, ...]:
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [n for n in names if n not in GROUPS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown group(s) {bad}; choose from {', '.join(GROUPS)}")
    return names


def _mechanisms(text: str) -> tuple[str, ...]:
    from .mechanisms import MECHANISMS
    names = tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    bad = [n for n in names if n not in MECHANISMS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown mechanism(s) {bad}; choose from {', '.join(MECHANISMS)}")
    return names


def _ids(text: str) -> list[str]:
    ids = [x for x in text.split(",") if x]
    if not ids:
        raise argparse.ArgumentTypeError(f"{text!r} names no point")
    return ids


def _named_path(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=PATH")
    return name.strip(), Path(path.strip())


def _policies(text: str) -> tuple[str, ...]:
    from servecap.core.policies import PrefillPolicy
    names = tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    try:
        for n in names:
            PrefillPolicy.parse(n)
    except (InputError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names no prefill policy")
    return names


def parser() -> argparse.ArgumentParser:
    top = Parser(prog="python -m validate", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = top.add_subparsers(dest="step", required=True, metavar="STEP")
    common = Parser(add_help=False)
    common.add_argument("--out", type=Path, default=Path("results/validation"), help="directory (default %(default)s)")

    pred = sub.add_parser("predict", help="predict what each prefill policy buys, before the engine has it (CPU)")
    pred.add_argument("--out", type=Path, default=Path("results/predictions"), help="directory (default %(default)s)")
    pred.add_argument("--table", type=Path, help="the cost table to predict from (default: the shipped H200 table)")
    pred.add_argument("--azure", type=Path, metavar="CSV", help="the Azure LLM inference trace (conversation) CSV")
    pred.add_argument("--n", type=count_arg, default=400, help="requests per arrival point (default %(default)s)")
    pred.add_argument("--seed", type=seed_arg, default=0, help="workload seed (default %(default)s)")
    pred.add_argument("--force", action="store_true", help="replace existing predictions")

    sag = sub.add_parser("sag", help="search the simulator for served-rate sags past capacity (CPU)")
    sag.add_argument("--out", type=Path, default=Path("results/sag"), help="directory (default %(default)s)")
    sag.add_argument("--table", type=Path, help="cost table (default: the shipped H200 table)")
    sag.add_argument("--jobs", type=count_arg, help="worker processes (default: every core)")
    sag.add_argument("--force", action="store_true", help="replace an existing search (or comparison)")
    sag.add_argument("--compare", type=Path, metavar="VALIDATION",
                     help="instead of searching: compare the candidates' real runs in VALIDATION with their predictions")
    sag.add_argument("--allow-nonstationary", action="store_true", help="with --compare: as for report")

    noise = sub.add_parser("noise", help="the engine's run-to-run noise from repeated real runs (CPU)")
    noise.add_argument("validations", type=Path, nargs="+", metavar="VALIDATION", help="validation directories")
    noise.add_argument("--out", type=Path, default=Path("servecap/costs/data/run_to_run.json"), help="(default %(default)s)")
    noise.add_argument("--force", action="store_true", help="replace an existing file")
    noise.add_argument("--table", type=Path, help="a cost table: also each run's speed, and what speed leaves "
                       "unexplained (the intervals then propagate speed through the simulator)")
    noise.add_argument("--sessions-from", type=Path, metavar="NOISE_JSON",
                       help="take the GPU-to-GPU spread of a run's speed from this earlier noise file (its sessions) "
                            "instead of these validations' (which need three GPUs): an engine measured on fewer")
    noise.add_argument("--allow-nonstationary", action="store_true", help="accept a table whose stationarity "
                       "check failed")

    plan = sub.add_parser("plan", parents=[common], help="choose the points and write their predictions (CPU)")
    plan.add_argument("--table", type=Path, help="the frozen cost table (default: the shipped H200 table)")
    plan.add_argument("--n", type=count_arg, default=400, help="requests per arrival point (default %(default)s)")
    plan.add_argument("--seed", type=seed_arg, default=0, help="workload seed (default %(default)s)")
    plan.add_argument("--azure", type=Path, metavar="CSV", help="the Azure LLM inference trace (conversation) CSV")
    plan.add_argument("--sharegpt", type=Path, metavar="CSV", help="the ShareGPT lengths CSV (sarathi-serve's)")
    plan.add_argument("--azure-from", type=seconds_arg, default=0.0, metavar="S",
                      help="the Azure points replay the trace's requests from S seconds into it (default 0: its "
                           "first; another window is other traffic of the same service)")
    plan.add_argument("--skip", type=_skip, default=(), metavar="GROUP,...",
                      help=f"leave out point groups ({', '.join(GROUPS)}); the plan records what it left out")
    plan.add_argument("--sag", type=Path, metavar="JSON", help="sag candidates to run (results/sag/candidates.json)")
    plan.add_argument("--predictions", type=Path, metavar="DIR",
                      help="the blind prefill-policy predictions (results/predictions): their points are run too")
    plan.add_argument("--force", action="store_true", help="replace an existing plan")
    plan.add_argument("--public-policies", type=_policies, default=("padded",), metavar="P1,P2",
                      help="plan the public-trace points for each of these prefill policies (default padded)")
    plan.add_argument("--repeats", type=count_arg, metavar="K",
                      help="K runs at every point near and past capacity (public traces and mechanisms), each on a "
                           "newly started engine, so that the engine's own spread is measured there (default: one at "
                           "the public points, the mechanisms' own counts)")
    plan.add_argument("--mechanisms", type=_mechanisms, default=(), metavar="M1,M2",
                      help="also plan the points of these mechanisms, each beside the policy it replaces: on-demand "
                           "(admission with preemption), mixed (fused steps), prefix-cache (servecap/validate/mechanisms.py)")
    plan.add_argument("--cache-trace", type=_named_path, action="append", metavar="NAME=PATH",
                      help="with --mechanisms prefix-cache: a trace file with prefix hashes (repeatable)")
    plan.add_argument("--max-num-batched-tokens", type=step_cap_arg, metavar="N",
                      help="every point's per-step token cap, in its capacity search too (a full-length trace's "
                           "long prompts beside 32 rows: the --full-length table's 131072)")
    plan.add_argument("--interval", type=level_arg, metavar="LEVEL",
                      help="freeze a LEVEL%% band for every point's metrics with the predictions (servecap/sim/intervals.py)")
    plan.add_argument("--cost-draws", choices=("together", "apart"), default="together",
                      help="with --interval: every step kind's cost drawn at one z (default), or decode's and the "
                           "prompt steps' apart, as independent draws (servecap/sim/intervals.py)")
    plan.add_argument("--allow-nonstationary", action="store_true",
                      help="plan from a table whose stationarity check failed (the plan and report say so)")
    plan.add_argument("--only", metavar="ID1,ID2", type=_ids,
                      help="keep only these of the chosen points, by id with or without its rate (azure-conv-near); "
                           "the rest are left out of the plan, named in it: a validation sized to the device time "
                           "there is")
    plan.add_argument("--points-from", type=Path, metavar="PLAN_DIR",
                      help="predict an earlier plan's points as they are (their traces copied here), so that the same "
                           "real runs, made under that plan, grade both; no option that chooses points goes with it")

    real = sub.add_parser("real", parents=[common], help="run the plan's points on the engine (GPU; resumes)")
    real.add_argument("--expect-gpu", metavar="NAME", help="refuse any other device, e.g. 'NVIDIA H200'")
    real.add_argument("--only", metavar="ID1,ID2", type=_ids,
                      help="run only these points, by id with or without its rate (azure-conv-near)")
    real.add_argument("--shard", type=_shard, default=(0, 1), metavar="I/N",
                      help="run the I-th of N shares of the plan's single-engine points (one process per GPU)")
    real.add_argument("--fleet", metavar="DEV1,DEV2", type=lambda t: t.split(","),
                      help="run the plan's fleet points instead, one replica on each of these CUDA devices (repeat a "
                           "device to put two replicas on one GPU)")
    real.add_argument("--pending", action="store_true",
                      help="run nothing: list the single-engine runs still to make (missing or interrupted) and the "
                           "--only that makes them (CPU)")

    pol = sub.add_parser("policies", parents=[common], help="the prefill policies: blind, re-calibrated, measured (CPU)")
    pol.add_argument("--predictions", type=Path, default=Path("results/predictions"),
                     help="the blind predictions' directory; the report goes there (default %(default)s)")
    pol.add_argument("--table", type=Path, help="the plan's (re-calibrated) table")
    pol.add_argument("--allow-nonstationary", action="store_true", help="as for report")
    pol.add_argument("--force", action="store_true", help="replace an existing report")

    cov = sub.add_parser("coverage", parents=[common],
                         help="the share of real measurements inside their predicted band (CPU): the plan's frozen "
                              "intervals, or with --interval re-predicted from the same table (retrospective)")
    cov.add_argument("--table", type=Path, help=GRADED_TABLE)
    cov.add_argument("--interval", type=level_arg, metavar="LEVEL", help="for a plan that froze none")
    cov.add_argument("--force", action="store_true", help="replace an existing coverage report")
    cov.add_argument("--allow-nonstationary", action="store_true", help="as for report")

    mech = sub.add_parser("mechanisms", parents=[common],
                          help="graded report of a plan's --mechanisms points: blind, re-calibrated, real (CPU)")
    mech.add_argument("--table", type=Path, help=GRADED_TABLE)
    mech.add_argument("--recalibrated", type=Path, metavar="TABLE",
                      help="also predict every point from this table (calibrate --from-runs of real runs)")
    mech.add_argument("--force", action="store_true", help="replace an existing mechanisms.md")

    rep = sub.add_parser("replay", parents=[common],
                         help="each real run through the simulator's scheduler at its own recorded step times: "
                              "whether scheduling is the engine's, run by run (CPU)")
    rep.add_argument("--only", metavar="ID1,ID2", type=_ids,
                     help="replay only these points' runs, by id with or without its rate")
    rep.add_argument("--force", action="store_true", help="replace an existing replay.md and replay.json")

    report = sub.add_parser("report", parents=[common], help="predicted beside measured (CPU)")
    report.add_argument("--table", type=Path, help=GRADED_TABLE)
    report.add_argument("--force", action="store_true", help="replace an existing report")
    report.add_argument("--allow-nonstationary", action="store_true",
                        help="grade against a table whose stationarity check failed (the report says so)")
    return top


@command("validate")
def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    # Every step writes into --out (noise: the file --out; policies: into --predictions): an unwritable one is found
    # before minutes of work.
    check_out_dir(args.out.parent if args.step == "noise" else args.out)
    if args.step in ("coverage", "mechanisms", "report") and args.table is None:
        from .comparison import own_table
        args.table = own_table(args.out)
    if args.step == "policies":
        check_out_dir(args.predictions)
    if args.step == "predict":
        from .predict import make_predictions
        doc = make_predictions(args.table, args.out, azure=args.azure, n=args.n, seed=args.seed,
                               force=args.force)
        print(f"wrote {args.out / 'predictions.json'} and predictions.md: {len(doc['points'])} points")
    elif args.step == "coverage":
        from .coverage import write as write_coverage
        print(f"wrote {write_coverage(args.out, args.table, args.interval, args.allow_nonstationary, args.force)}")
    elif args.step == "noise":
        from .noise import describe, write
        from servecap.sim import inputs
        table = args.table and inputs.load_table(args.table, allow_nonstationary=args.allow_nonstationary)
        doc = write(args.validations, args.out, args.force, table, args.sessions_from)
        print(f"wrote {args.out}: {describe(doc)}")
    elif args.step == "sag" and args.compare:
        from .sag import compare_real
        print(f"wrote {compare_real(args.compare, args.out, args.table, args.allow_nonstationary, args.force)}")
    elif args.step == "sag":
        from .sag import search, write_report
        doc = search(args.table, args.out, jobs=args.jobs, force=args.force,
                     progress=lambda m: print(m, file=sys.stderr))
        print(f"wrote {write_report(doc, args.out)}, search.json, candidates.json and sag.png")
    elif args.step == "mechanisms":
        from .mechanisms_report import grade
        print(f"wrote {grade(args.out, args.table, args.recalibrated, args.force)}")
    elif args.step == "plan":
        from .plan import make_plan
        chooses = [f"--{k.replace('_', '-')}" for k in ("azure", "sharegpt", "sag", "predictions", "repeats",
                                                          "cache_trace", "max_num_batched_tokens", "azure_from")
                   if getattr(args, k)] + [f"--{k}" for k in ("skip", "mechanisms", "only") if getattr(args, k)]
        if args.points_from is not None and chooses:
            raise InputError(f"--points-from takes the earlier plan's points as they are; "
                             f"{', '.join(chooses)} would choose others")
        if args.cost_draws == "apart" and args.interval is None:
            raise InputError("--cost-draws apart draws the bands' costs: it needs --interval")
        points = make_plan(args.table, args.out, n=args.n, seed=args.seed, azure=args.azure,
                           sharegpt=args.sharegpt, skip=args.skip, sag=args.sag,
                           predictions=args.predictions, force=args.force,
                           allow_nonstationary=args.allow_nonstationary, interval=args.interval,
                           apart=args.cost_draws == "apart", public_policies=args.public_policies, repeats=args.repeats,
                           mechanisms=args.mechanisms, cache_traces=dict(args.cache_trace or []) or None,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           points_from=args.points_from, only=args.only, azure_from_s=args.azure_from)
        print(f"wrote {args.out / 'plan.json'}: {len(points)} points")
        for p in points:
            print(f"  {p.id:40s} {p.role:12s} {p.serving.backend} {p.serving.prefill} {p.serving.admission}"
                  f"{' cache' * p.serving.prefix_cache} rows {p.serving.max_batch} "
                  f"pool {p.serving.pool.gib or 'engine'} x{p.repeats}" + (f" after {p.warmup} warm-up" if p.warmup else "")
                  + (" (fresh engine)" if p.fresh else ""))
    elif args.step == "replay":
        from .replay_report import write as write_replay
        path, same, n = write_replay(args.out, args.only, args.force,
                                     progress=lambda m: print(m, file=sys.stderr))
        print(f"wrote {path} and replay.json: {same} of {n} runs identical")
    elif args.step == "policies":
        from .policies import write
        print(f"wrote {write(args.out, args.predictions, args.table, args.allow_nonstationary, args.force)}")
    elif args.step == "real":
        if args.pending:
            if args.fleet:
                raise InputError("--pending lists the single-engine runs; it does not go with --fleet")
            from .real import describe_pending, pending
            print(describe_pending(*pending(args.out, args.only, args.shard)))
        elif args.fleet:
            from .real import run_fleet
            run_fleet(args.out, args.fleet, args.expect_gpu, args.only)
        else:
            from .real import run_real
            run_real(args.out, args.expect_gpu, args.only, args.shard)
    else:
        from .report import write_report
        print(f"wrote {write_report(args.out, args.table, force=args.force, allow_nonstationary=args.allow_nonstationary)}")
    return 0
