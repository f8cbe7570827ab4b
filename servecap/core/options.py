"""The command-line options that name the scheduler's policies, for every CLI that runs it (sim, engine): parsed
by the policies' own registries, so a bad name is the one-line error the registry gives."""
from __future__ import annotations

import argparse
from typing import Callable

from servecap.traces.arg_types import checked
from servecap.traces.errors import InputError

from .policies import AdmissionPolicy, PrefillPolicy

PREFILL_HELP = ("prefill policy: padded (each group padded to its widest prompt), packed (true lengths), chunked:N "
                "(N prompt tokens a step between decode steps) or mixed:N (every decode row and prompt tokens fused "
                "in one step of N tokens, N >= max batch)")


def _parsed(parse: Callable[[str], object]) -> Callable[[str], str]:
    def arg(text: str) -> str:
        try:
            return str(parse(text))
        except InputError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return arg


policy_arg = _parsed(PrefillPolicy.parse)
admission_arg = _parsed(AdmissionPolicy.parse)
on_off_arg = checked(lambda v: {"on": True, "off": False}.get(v, v), lambda v: isinstance(v, bool), "on or off")


step_cap_arg = checked(int, lambda v: v >= 1, "a whole number of tokens >= 1")


def add_scheduler_options(p: argparse.ArgumentParser, many: Callable | None = None) -> None:
    """--admission and --prefix-cache: one value each, or with `many` (a list type maker) a list, each a sweep
    axis; and --max-num-batched-tokens, one value (a sweep's every configuration has it)."""
    kind = many or (lambda f: f)
    p.add_argument("--admission", type=kind(admission_arg), default=["reserve"] if many else "reserve",
                   metavar="A1,A2" if many else "POLICY",
                   help="KV admission: reserve (prompt + whole budget at admission) or on-demand (blocks as tokens "
                        "are written, preempting the newest request by recompute when none is free) "
                        "(default reserve)")
    p.add_argument("--prefix-cache", type=kind(on_off_arg), default=[False] if many else False,
                   metavar="off,on" if many else "on|off",
                   help="share full prompt blocks by the trace's hash ids (default off)")
    p.add_argument("--max-num-batched-tokens", type=step_cap_arg, metavar="N",
                   help="the most positions one prefill step computes (vLLM's name): a padded or packed admission "
                        "group stops before its step would pass N, so that long prompts and a large batch fit one "
                        "engine; chunked:N and mixed:N steps must fit in it (default: no cap)")
