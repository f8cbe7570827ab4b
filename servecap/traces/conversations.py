"""Seeded multi-turn conversations for prefix-cache studies: sessions arrive as a Poisson process, and each turn's
prompt is its session's whole history (the shared system prompt, every earlier user message and answer) followed by
a new user message, with hash ids saying which of its blocks earlier requests already held.

Each quantity is drawn from its own stream of raw PCG64 words (the same on every NumPy version), so the same
(sessions, seed, shape) holds the same conversations at every rate:
- turns per session: geometric on 1, 2, 3, ... with mean `turns` (1: every session a single turn);
- new user tokens and output tokens per turn: exponential with the given mean, rounded, at least 1;
- think time before each later turn: exponential with mean think_s seconds (0: no pause);
- the system prompt: system_tokens, the same tokens opening every session (0: none).
A session's k-th prompt is about system_tokens + k * user_tokens + (k - 1) * output_tokens long: nothing caps it.

Arrivals: sessions start at poisson_arrivals(rate, sessions, seed); a later turn arrives a think time after the
previous turn *arrived*. A trace cannot know when that turn was answered (serving decides that), so with think times
short against a turn's latency a turn can arrive before its predecessor is answered: choose think times long against
the latency the run will have.

Hash ids, one per hash_block tokens: a full block inside the system prompt gets the id of ("system", block index),
the same in every session; any other full block the id of (session, block index), since a session's history only
grows and its block i holds the same tokens in every later turn; a last, partial block the id of (session, block
index, its length), since the next turn's block i is longer and so other content. Ids are numbered 0, 1, 2, ... in
the order the trace (in arrival order) first meets them. They are chained as Mooncake's: two blocks with one id
have equal blocks before them.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from .errors import InputError
from .workload import ARRIVAL_DECIMALS, Request, Trace, poisson_arrivals, uniforms

# Streams of raw words, apart from workload.py's (1-5; session starts use its arrival stream, 2).
TURNS, USER, OUTPUT, THINK = 10, 11, 12, 13
DEFAULT_SESSIONS = 100


@dataclass(frozen=True)
class Conversations:
    """The shape of the sessions (means of the distributions in the module's docstring)."""

    system_tokens: int = 1024
    turns: float = 4.0
    user_tokens: float = 128.0
    output_tokens: float = 256.0
    think_s: float = 30.0
    hash_block: int = 512

    def __post_init__(self):
        for name, minimum in (("system_tokens", 0), ("hash_block", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise InputError(f"{name} must be a whole number >= {minimum}, got {value!r}")
        for name, minimum in (("turns", 1.0), ("user_tokens", 1.0), ("output_tokens", 1.0), ("think_s", 0.0)):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= minimum):
                raise InputError(f"the mean {name} must be a number >= {minimum:g}, got {value!r}")


def _geometric(u: np.ndarray, mean: float) -> np.ndarray:
    """Geometric on 1, 2, ... with `mean` (success odds 1/mean), by inverting its distribution at u in (0, 1)."""
    if mean == 1.0:
        return np.ones(len(u), dtype=np.int64)
    return 1 + np.floor(np.log(u) / math.log1p(-1.0 / mean)).astype(np.int64)


def _exponential_tokens(u: np.ndarray, mean: float) -> np.ndarray:
    return np.maximum(1, np.rint(-mean * np.log(u))).astype(np.int64)


def conversation_trace(rate: float, sessions: int, seed: int = 0, shape: Conversations = Conversations()) -> Trace:
    """`sessions` seeded conversations starting at `rate` sessions per second (see the module's docstring): one
    request per turn, in arrival order, each with its prompt's hash ids in blocks of shape.hash_block tokens."""
    if isinstance(sessions, bool) or not isinstance(sessions, int) or sessions < 1:
        raise InputError(f"sessions must be a whole number >= 1, got {sessions!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise InputError(f"seed must be a whole number >= 0, got {seed!r}")
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
        raise InputError(f"the session rate must be a positive number of sessions per second, got {rate!r}")
    starts = poisson_arrivals(rate, sessions, seed)
    turns = _geometric(uniforms(seed, TURNS, sessions), shape.turns)
    total = int(turns.sum())
    user = _exponential_tokens(uniforms(seed, USER, total), shape.user_tokens).tolist()
    output = _exponential_tokens(uniforms(seed, OUTPUT, total), shape.output_tokens).tolist()
    think = (-shape.think_s * np.log(uniforms(seed, THINK, total))).tolist()
    turn_rows = []  # (arrival, session, turn, prompt tokens, budget): sorted, a session's turns stay in order
    k = 0
    for session, (start, n) in enumerate(zip(starts, turns.tolist())):
        t, history = start, shape.system_tokens
        for turn in range(n):
            t += think[k] if turn else 0.0
            prompt = history + user[k]
            turn_rows.append((round(t, ARRIVAL_DECIMALS), session, turn, prompt, output[k]))
            history = prompt + output[k]
            k += 1
    turn_rows.sort()
    ids: dict[tuple, int] = {}
    reqs = [Request(i, a, p, b, "", _block_ids(session, p, shape, ids), shape.hash_block)
            for i, (a, session, _, p, b) in enumerate(turn_rows)]
    return Trace(reqs, {"kind": "conversations", "session_rate": rate, "sessions": sessions, "seed": seed,
                        **asdict(shape)})


def _block_ids(session: int, prompt: int, shape: Conversations, ids: dict[tuple, int]) -> tuple[int, ...]:
    """The hash ids of a prompt of `prompt` tokens in `session`, numbering the blocks `ids` has not met yet."""
    block, out = shape.hash_block, []
    for i in range(-(-prompt // block)):
        end = min((i + 1) * block, prompt)
        if end - i * block < block:
            key = (session, i, end - i * block)
        elif end <= shape.system_tokens:
            key = ("system", i)
        else:
            key = (session, i)
        out.append(ids.setdefault(key, len(ids)))
    return tuple(out)
