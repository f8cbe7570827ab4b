"""`python -m traces`: make the seeded workload traces, import public ones, summarise a trace file, and look
inside run records: where their time goes (explain) and their steps and rows on a timeline (timeline)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


from .arg_types import count_arg, mean_arg, rate_arg, requests_arg, seconds_arg, seed_arg, tokens_arg
from .arrival_options import add_arrival_options
from .command import Parser, command
from .conversations import DEFAULT_SESSIONS, Conversations, conversation_trace
from .errors import InputError
from .outpath import reason
from .importers import (FORMATS, TIME_UNITS, ImportOptions, import_azure, import_lengths, import_mooncake,
                        import_note, import_table, time_unit_warning)
from .outpath import check_new_file
from .model_spec import DEFAULT_BLOCK_SIZE, DEFAULT_MODEL, MODELS
from .prefix import cached_prefix_share, repeated_block_share
from .prompts import PROMPT_NAMES
from .trace_io import read_trace, write_trace
from .workload import (BEYOND_POSITIONS_HINT, DEFAULT_BUDGET, DEFAULT_N, Trace, beyond_positions, closed_mixed,
                       closed_uniform, poisson_trace)

# Records, explain and timeline bring pandas: imported by the commands that read records, since `engine` imports this
# module's workload options and its --help should not wait for pandas.


def _window(text: str) -> tuple[float, float]:
    start, _, end = text.partition(":")
    try:
        return float(start), float(end)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not START:END in seconds, e.g. 600:1200") from None


def _check_out(args: argparse.Namespace) -> None:
    """Refuse to write a trace over an existing file without --force, and over the file being imported at all."""
    source = getattr(args, "path", None)  # the importers' input file
    check_new_file(args.out, force=args.force, keep={"the file being imported": source})


def _write(trace: Trace, out: str) -> None:
    write_trace(trace, out)
    print(f"wrote {out}: trace {trace.trace_id}, {len(trace)} requests")
    # Said now, not first when the simulator or engine refuses the trace: a full-length public trace holds such
    # requests, and the import is where --max-prompt and --max-budget keep the rest.
    positions = int(MODELS[DEFAULT_MODEL]["max_position_embeddings"])
    over = len(beyond_positions(trace.requests, positions))
    if over:
        print(f"warning: {over:,} requests are beyond {DEFAULT_MODEL}'s {positions} positions (prompt + output), "
              f"which the simulator and engine refuse; {BEYOND_POSITIONS_HINT}", file=sys.stderr)


def _poisson(args: argparse.Namespace) -> None:
    _write(poisson_trace(args.rate, args.n, args.seed, args.burstiness, args.ramp_up_s), args.out)


def _conversations(args: argparse.Namespace) -> None:
    shape = Conversations(args.system_tokens, args.turns, args.user_tokens, args.output_tokens, args.think_s,
                          args.hash_block)
    trace = conversation_trace(args.rate, args.sessions, args.seed, shape)
    _write(trace, args.out)
    print(f"{args.sessions} sessions, {len(trace)} turns; {repeated_block_share(trace.requests):.1%} of the prompts' "
          f"{args.hash_block}-token blocks repeat an earlier request's")


def _closed(args: argparse.Namespace) -> None:
    # The options that do not apply are refused rather than ignored, so no one believes they took effect.
    if args.mixed and args.budget is not None:
        raise InputError("--budget applies to --prompt; a mixed draw picks each request's budget")
    if args.prompt and args.seed is not None:
        raise InputError("--seed applies to --mixed; --prompt repeats one prompt and budget")
    trace = closed_mixed(args.n, args.seed or 0) if args.mixed else \
        closed_uniform(args.prompt, args.n, args.budget or DEFAULT_BUDGET)
    _write(trace, args.out)


def _options(args: argparse.Namespace, time_unit: str = "s") -> ImportOptions:
    return ImportOptions(args.max_prompt, args.max_budget, args.window, args.compress, time_unit)


def _import_azure(args: argparse.Namespace) -> None:
    trace, report = import_azure(args.path, _options(args))
    print(report)
    _write(trace, args.out)


def _import_mooncake(args: argparse.Namespace) -> None:
    trace, report = import_mooncake(args.path, _options(args))
    print(report)
    _write(trace, args.out)


def _import(args: argparse.Namespace) -> None:
    trace, report = import_table(args.path, args.timestamp, args.input, args.output,
                                 _options(args, args.time_unit), args.format)
    print(report)
    warning = time_unit_warning(trace)
    if warning:
        print(warning, file=sys.stderr)
    _write(trace, args.out)


def _import_lengths(args: argparse.Namespace) -> None:
    trace, report = import_lengths(args.path, args.input, args.output, args.rate, args.n, args.seed,
                                   args.max_prompt, args.max_budget, args.format)
    print(report)
    _write(trace, args.out)


def summary(trace: Trace) -> str:
    """A few lines on a trace: id, size, span, offered rate, length percentiles and metadata."""
    lines = [f"trace id       {trace.trace_id}", f"requests       {len(trace)}"]
    if trace.requests:
        rate = trace.offered_rate
        lines += [f"span           {trace.span:.3f} s (arrivals {trace.requests[0].arrival:g} .. "
                  f"{trace.requests[-1].arrival:g} s)",
                  "offered rate   " + ("n/a: every request arrives at once" if rate is None else f"{rate:.3f} req/s")]
        for name, values in (("prompt tokens", [r.prompt_tokens for r in trace.requests]),
                             ("budget", [r.budget for r in trace.requests])):
            p50, p90, p99 = np.percentile(values, [50, 90, 99])
            lines.append(f"{name:<15}p50 {p50:g}  p90 {p90:g}  p99 {p99:g}  max {max(values)}")
        hashed = [r for r in trace.requests if r.hash_ids]
        if hashed:
            blocks = sorted({r.hash_block for r in hashed})
            lines.append(f"hash ids       {len(hashed)} requests, blocks of {'/'.join(map(str, blocks))} tokens; "
                         f"{repeated_block_share(trace.requests):.1%} of their blocks repeat an earlier request's; "
                         f"an unbounded cache of {DEFAULT_BLOCK_SIZE}-token blocks would hold "
                         f"{cached_prefix_share(trace.requests, DEFAULT_BLOCK_SIZE):.1%} of all prompt tokens")
    note = import_note(trace.meta)
    if note:
        lines.append(f"import         {note}")
    lines.append("meta           " + json.dumps(trace.meta, indent=2, sort_keys=True).replace("\n", "\n               "))
    return "\n".join(lines)


def _show(args: argparse.Namespace) -> None:
    print(summary(read_trace(args.file)))


def _records(paths: list[str]) -> list:
    """The run records at `paths`, warning (not refusing) about any its run never closed."""
    from .records import read_run, unfinished
    records = [read_run(p) for p in paths]
    for path, rec in zip(paths, records):
        warning = unfinished(rec)
        if warning:
            print(f"warning: {path}: {warning}", file=sys.stderr)
    return records


def _read(runs: list[str]) -> dict[str, str]:
    """The run records a command reads, for check_new_file to keep."""
    return {f"the run record {r} it reads": r for r in runs}


def _explain(args: argparse.Namespace) -> None:
    from .explain import explain
    from .explain_report import report, report_pair
    if len(args.runs) > 2:
        raise InputError(f"explain takes one or two run records, got {len(args.runs)}")
    if args.png:
        check_new_file(args.png, force=args.force, keep=_read(args.runs), option="--png")
        if Path(args.png).suffix.lower() != ".png":
            raise InputError("is not a .png file name; --png draws a PNG", path=args.png)
    elif args.force:
        raise InputError("--force does nothing without --png (the only file explain writes)")
    explained = []
    for path, rec in zip(args.runs, _records(args.runs)):
        try:
            explained.append(explain(rec, args.windows))
        except InputError as e:  # the record's problem: name the record
            raise InputError(str(e), path=path) from None
    print(report(explained[0], args.runs[0]) if len(explained) == 1 else report_pair(*explained, tuple(args.runs)))
    if args.png:
        from .explain_plot import plot  # matplotlib only when a figure is asked for
        kinds = [str(e.meta.get("kind", "record")) for e in explained]
        names = kinds if len(kinds) == 1 else [f"{tag} ({k})" for tag, k in zip("AB", kinds)]
        print(f"wrote {plot(explained, names, args.png)}")


def _timeline(args: argparse.Namespace) -> None:
    from .timeline import write_timeline
    check_new_file(args.json_out, force=args.force, keep=_read(args.runs))
    records = _records(args.runs)
    out = write_timeline(records, args.json_out, args.names, args.every_step)
    print(f"wrote {out}: {len(records)} record(s); open it in ui.perfetto.dev or chrome://tracing")


def parser() -> argparse.ArgumentParser:
    from .explain import DEFAULT_WINDOWS
    p = Parser(prog="python -m traces", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    out = Parser(add_help=False)
    out.add_argument("--out", required=True, metavar="FILE", help="trace file to write")
    out.add_argument("--force", action="store_true", help="overwrite FILE if it exists")

    s = sub.add_parser("poisson", parents=[out], help="the seeded Poisson arrival trace (rate, n, seed; "
                                                                "--burstiness for gamma arrivals, --ramp-up-s)")
    s.add_argument("--rate", type=rate_arg, required=True, help="arrivals per second")
    s.add_argument("--n", type=requests_arg, default=DEFAULT_N, help=f"requests (default {DEFAULT_N})")
    s.add_argument("--seed", type=seed_arg, default=0, help="seed of the mixed draw and the arrival gaps (default 0)")
    add_arrival_options(s)
    s.set_defaults(func=_poisson)

    d = Conversations()
    s = sub.add_parser("conversations", parents=[out],
                       help="seeded multi-turn conversations sharing prefixes, with their prompts' block hashes",
                       description="Sessions start as a Poisson process at --rate; each turn's prompt is its "
                                   "session's history (the system prompt, the earlier user messages and answers) "
                                   "plus new user tokens, its hash ids chained so that equal prefixes have equal ids "
                                   "(servecap/traces/conversations.py). A later turn arrives a think time after the previous "
                                   "turn's arrival: a trace cannot know when that turn was answered. Every draw is "
                                   "seeded: the same sessions, seed and shape give the same conversations at every "
                                   "rate.")
    s.add_argument("--rate", type=rate_arg, required=True, help="sessions starting per second (Poisson)")
    s.add_argument("--sessions", type=requests_arg, default=DEFAULT_SESSIONS,
                   help=f"sessions (default {DEFAULT_SESSIONS})")
    s.add_argument("--seed", type=seed_arg, default=0, help="seed of every draw (default 0)")
    s.add_argument("--system-tokens", type=tokens_arg, default=d.system_tokens, metavar="N",
                   help=f"system prompt opening every session, the same tokens in all (default {d.system_tokens})")
    s.add_argument("--turns", type=mean_arg, default=d.turns, metavar="MEAN",
                   help=f"turns per session: geometric, at least 1, with this mean (default {d.turns:g})")
    s.add_argument("--user-tokens", type=mean_arg, default=d.user_tokens, metavar="MEAN",
                   help=f"new user tokens per turn: exponential with this mean, at least 1 (default {d.user_tokens:g})")
    s.add_argument("--output-tokens", type=mean_arg, default=d.output_tokens, metavar="MEAN",
                   help=f"output tokens per turn: exponential with this mean, at least 1 (default {d.output_tokens:g})")
    s.add_argument("--think-s", type=seconds_arg, default=d.think_s, metavar="MEAN",
                   help=f"seconds from a turn's arrival to the next's: exponential with this mean (default "
                        f"{d.think_s:g}; from the arrival, not the answer, which a trace cannot know)")
    s.add_argument("--hash-block", type=count_arg, default=d.hash_block, metavar="N",
                   help=f"tokens per hashed prompt block (default {d.hash_block}, Mooncake's; the engine's KV block "
                        f"is {DEFAULT_BLOCK_SIZE})")
    s.set_defaults(func=_conversations)

    s = sub.add_parser("closed", parents=[out], help="a closed run: n requests all arriving at t=0")
    which = s.add_mutually_exclusive_group(required=True)
    which.add_argument("--mixed", action="store_true", help="a mixed draw of prompts and budgets")
    which.add_argument("--prompt", choices=PROMPT_NAMES, help="every request has this prompt")
    s.add_argument("--n", type=requests_arg, required=True, help="requests")
    s.add_argument("--seed", type=seed_arg, help="seed of the mixed draw (default 0)")
    s.add_argument("--budget", type=count_arg, help=f"tokens each --prompt request generates (default {DEFAULT_BUDGET})")
    s.set_defaults(func=_closed)

    caps = Parser(add_help=False, parents=[out])
    caps.add_argument("--max-prompt", type=int, metavar="TOKENS",
                      help="drop requests with longer prompts (default: none; every prompt kept at its length)")
    caps.add_argument("--max-budget", type=int, metavar="TOKENS",
                      help="clip longer outputs to this budget (default: none; every output kept at its length)")
    timed = Parser(add_help=False, parents=[caps])  # files with arrival times
    timed.add_argument("--window", type=_window, metavar="START:END",
                       help="keep requests from START to END seconds after the file's first timestamp")
    timed.add_argument("--compress", type=float, default=1.0, metavar="F",
                       help="divide arrival times by F, offering the same requests at F times the rate")

    s = sub.add_parser("import-azure", parents=[timed], help="import the Azure LLM inference trace 2023 CSV")
    s.add_argument("path", help="AzureLLMInferenceTrace_conv.csv or _code.csv")
    s.set_defaults(func=_import_azure)

    s = sub.add_parser("import-mooncake", parents=[timed],
                       help="import a Mooncake trace (JSONL: timestamp in ms, input_length, output_length, hash_ids), "
                            "keeping its 512-token block hashes")
    s.add_argument("path", help="e.g. Mooncake's FAST25-release/traces/*.jsonl")
    s.set_defaults(func=_import_mooncake)

    s = sub.add_parser("import", parents=[timed], help="import a CSV or JSONL trace, naming its columns")
    s.add_argument("path", help="a .csv, or a .jsonl with one JSON object per line")
    s.add_argument("--timestamp", required=True, metavar="COL", help="arrival time: numbers or ISO datetimes")
    s.add_argument("--time-unit", choices=TIME_UNITS, default="s",
                   help="the unit of numeric timestamps (default s); ISO datetimes are read as they are")
    s.add_argument("--input", required=True, metavar="COL", help="prompt tokens")
    s.add_argument("--output", required=True, metavar="COL", help="output tokens")
    s.add_argument("--format", choices=FORMATS, help="file format (default: from the suffix, .jsonl or .csv)")
    s.set_defaults(func=_import)

    s = sub.add_parser("import-lengths", parents=[caps],
                       help="resample a file of prompt and output lengths (e.g. ShareGPT's) with Poisson arrivals")
    s.add_argument("path", help="a .csv, or a .jsonl with one JSON object per line")
    s.add_argument("--input", required=True, metavar="COL", help="prompt tokens")
    s.add_argument("--output", required=True, metavar="COL", help="output tokens")
    s.add_argument("--rate", type=rate_arg, required=True, help="arrivals per second")
    s.add_argument("--n", type=requests_arg, default=DEFAULT_N, help=f"requests to draw (default {DEFAULT_N})")
    s.add_argument("--seed", type=seed_arg, default=0, help="seed of the row draw and the arrival gaps (default 0)")
    s.add_argument("--format", choices=FORMATS, help="file format (default: from the suffix, .jsonl or .csv)")
    s.set_defaults(func=_import_lengths)

    s = sub.add_parser("show", help="summarise a trace file")
    s.add_argument("file")
    s.set_defaults(func=_show)

    s = sub.add_parser("explain", help="where a run record's wall time goes; two records side by side",
                       description="Split a run record's wall time (first arrival to last finish) into decode, "
                                   "prefill of real prompt tokens, prefill padding, retire overhead, untimed gaps "
                                   "and idle, overall and by window, with admission groups against queue depth, "
                                   "head-of-line blocking and rows running. Two records (a real and a simulated "
                                   "run of one trace) print side by side with their differences.")
    s.add_argument("runs", nargs="+", metavar="RUN_DIR", help="one or two run-record directories")
    s.add_argument("--windows", type=count_arg, default=DEFAULT_WINDOWS, metavar="N",
                   help=f"split the wall time into N equal windows (default {DEFAULT_WINDOWS})")
    s.add_argument("--png", metavar="FILE", help="also draw the explanation into this PNG")
    s.add_argument("--force", action="store_true", help="replace an existing --png FILE")
    s.set_defaults(func=_explain)

    s = sub.add_parser("timeline", help="run records as a Chrome trace-event JSON for Perfetto",
                       description="Write run records as Chrome trace-event JSON (ui.perfetto.dev, chrome://tracing): "
                                   "one process per record (per replica, for a fleet's) with a steps track, one track "
                                   "per batch row, and queue depth and free KV blocks as counters.")
    s.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run-record directories")
    s.add_argument("--out", dest="json_out", required=True, metavar="FILE.json", help="the JSON file to write")
    s.add_argument("--names", type=lambda t: [n.strip() for n in t.split(",")], metavar="A,B,...",
                   help="process names, one per record (default: each record's kind, engine or sim)")
    s.add_argument("--every-step", action="store_true",
                   help="one event per decode step (default: one per stretch of decode steps of the same rows)")
    s.add_argument("--force", action="store_true", help="replace an existing --out FILE")
    s.set_defaults(func=_timeline)
    return p


@command("traces")
def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if hasattr(args, "out"):  # every command that writes a trace
            _check_out(args)
        args.func(args)
    except InputError:
        raise
    except OSError as e:  # the filesystem, past what the checks foresaw: still one line, in words
        raise InputError(reason(e), path=e.filename) from None
    return 0
