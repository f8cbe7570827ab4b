"""Requests and the seeded workloads every part replays: mixed draws, Poisson and closed traces.

The mix and the arrival gaps come from separate random streams, so the same (n, seed) holds the
same requests at every rate: a trace at rate 2r is the trace at rate r with time halved. Sweeps across
rates therefore compare like with like.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .errors import InputError
from .prompts import PROMPT_LENGTHS, PROMPT_NAMES

BUDGETS = (64, 128, 192, 256)
DEFAULT_BUDGET = 256
DEFAULT_N = 400
ARRIVAL_DECIMALS = 6  # microseconds: traces round-trip through text exactly
# Below 2**22 s (48.5 days) a float64 time resolves 1 ns; far past it a clock of 1e15 s moves in steps of 0.125 s,
# and adding a step's few milliseconds to it changes nothing (every TTFT 0).
MAX_ARRIVAL_S = 2.0 ** 22


def arrival_limit_error(arrival: float, request_id: int) -> str | None:
    """Why a run cannot start a request at `arrival` (seconds), or None."""
    if arrival < MAX_ARRIVAL_S:
        return None
    return (f"request {request_id} arrives at {arrival:g} s, beyond the limit of {MAX_ARRIVAL_S:,.0f} s (48.5 days), "
            f"past which float64 time is too coarse for step durations; shift the trace's times to start near 0")


@dataclass(frozen=True, slots=True)  # slots: a million-request trace is a million of these
class Request:
    """One request of a trace: when it arrives, how long its prompt is, how many tokens it generates, and (when the
    trace knows it) which of its prompt's blocks other requests share.

    hash_ids holds one id per hash_block tokens of the prompt, the last block possibly partial. The ids are chained
    as in Mooncake's traces: an id names a block's content together with every block before it, so two requests
    with the same id at block i have the same first i + 1 blocks."""

    request_id: int
    arrival: float
    prompt_tokens: int
    budget: int
    prompt: str = ""  # the named workload prompt (p16..p4096), or "" for a length-only request
    hash_ids: tuple[int, ...] = ()
    hash_block: int = 0  # tokens per hashed block; 0 when the request has no hash ids

    def at(self, arrival: float) -> Request:
        """The same request arriving at `arrival` (every field else kept, its hash ids too)."""
        return Request(self.request_id, arrival, self.prompt_tokens, self.budget, self.prompt, self.hash_ids,
                       self.hash_block)


def hash_error(prompt_tokens: int, hash_ids: Sequence[int], hash_block: int) -> str | None:
    """Why hash ids do not describe a prompt of `prompt_tokens`, or None: ids without a block size, a block size
    below 0, or not one id per block (the last block may be partial: ceil(prompt tokens / hash_block) ids)."""
    if hash_block == 0:
        return "has hash ids but no hash block size" if hash_ids else None
    if hash_block < 0:
        return f"hash block {hash_block} must be a number of tokens >= 1 (0 for no hash ids)"
    need = -(-prompt_tokens // hash_block)
    if len(hash_ids) != need:
        return f"has {len(hash_ids)} hash ids; a prompt of {prompt_tokens} tokens in blocks of {hash_block} needs {need}"
    return None


# What to do with requests longer than the model holds, said by the import that could keep them and by the
# simulator that refuses them.
BEYOND_POSITIONS_HINT = "import the trace again with --max-prompt to drop long prompts and --max-budget to clip outputs"


def beyond_positions(requests: Sequence[Request], positions: int) -> list[Request]:
    """The requests whose prompt and budget together pass the model's `positions`: the engine refuses each."""
    return [r for r in requests if r.prompt_tokens + r.budget > positions]


@dataclass
class Trace:
    requests: list[Request]
    meta: dict = field(default_factory=dict)

    @property
    def trace_id(self) -> str:
        """A stable id from the requests alone (not the metadata): same requests, same id. A request's hash ids
        count only when it has them, so a trace without any has the id it had before they existed."""
        h = hashlib.sha256()
        for r in self.requests:
            hashes = f",{r.hash_block},{' '.join(map(str, r.hash_ids))}" if r.hash_block or r.hash_ids else ""
            h.update(f"{r.request_id},{r.arrival:.{ARRIVAL_DECIMALS}f},{r.prompt_tokens},{r.budget},{r.prompt}"
                     f"{hashes}\n".encode())
        return h.hexdigest()[:16]

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def span(self) -> float:
        """Seconds from the first arrival to the last (requests are in arrival order)."""
        return self.requests[-1].arrival - self.requests[0].arrival if self.requests else 0.0

    def check_arrivals(self) -> None:
        """Refuse a trace whose last arrival is past MAX_ARRIVAL_S (the requests are in arrival order)."""
        why = self.requests and arrival_limit_error(self.requests[-1].arrival, self.requests[-1].request_id)
        if why:
            raise InputError(why)

    @property
    def offered_rate(self) -> float | None:
        """Requests per second between the first and last arrival; None when they coincide (a closed run)."""
        return (len(self.requests) - 1) / self.span if self.span > 0 else None


def _raw(seed: int, stream: int, count: int) -> np.ndarray:
    # Raw PCG64 words are identical across NumPy versions; the distribution methods are not promised to be.
    return np.random.PCG64(np.random.SeedSequence([seed, stream])).random_raw(count)


def mixed_draw(n: int, seed: int) -> list[tuple[str, int]]:
    """n (prompt name, budget) pairs: prompt uniform over the five, budget uniform over BUDGETS."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    raw = _raw(seed, 1, 2 * n)
    prompts = raw[0::2] % np.uint64(len(PROMPT_NAMES))
    budgets = raw[1::2] % np.uint64(len(BUDGETS))
    return [(PROMPT_NAMES[int(p)], BUDGETS[int(b)]) for p, b in zip(prompts, budgets)]


def poisson_arrivals(rate: float, n: int, seed: int, burstiness: float = 1.0, ramp_up_s: float = 0.0) -> list[float]:
    """Arrival times from t=0, rounded to microseconds: a Poisson process of `rate` per second, or with burstiness
    b != 1 a gamma renewal process (gaps of shape b and mean 1 / rate), optionally ramped up over the first ramp_up_s
    seconds (ramped())."""
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"arrival rate must be a positive number of requests per second, got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a positive number, got {burstiness}")
    if not (ramp_up_s >= 0 and math.isfinite(ramp_up_s)):
        raise ValueError(f"the ramp-up must be a number of seconds >= 0, got {ramp_up_s}")
    if burstiness == 1.0:
        u = ((_raw(seed, 2, n) >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53
        times = np.cumsum(-np.log(u) / rate)
    else:
        # vLLM's definition (benchmarks' get_request): gamma gaps of shape b and scale 1 / (rate b), mean 1 / rate.
        # NumPy's gamma sampler is not promised to stay the same across NumPy versions (the Poisson gaps, from raw
        # words, are): a bursty trace is reproducible on one NumPy version, and its trace id tells them apart.
        gen = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 5])))
        times = np.cumsum(gen.gamma(burstiness, 1.0 / (rate * burstiness), n))
    if ramp_up_s > 0:
        times = ramped(times, ramp_up_s)
    return [round(float(t), ARRIVAL_DECIMALS) for t in times]


def ramped(times: np.ndarray, ramp_up_s: float) -> np.ndarray:
    """Arrival times of a steady process moved so that its rate ramps linearly from 0 to the steady rate over
    ramp_up_s: the arrival at steady time a goes where the ramped process's expected count equals the steady one's,
    sqrt(2 S a) for a <= S/2, a + S/2 after (the inverse of the cumulative rate S -> t^2/(2S), then t - S/2)."""
    a = np.asarray(times, float)
    half = ramp_up_s / 2.0
    return np.where(a <= half, np.sqrt(2.0 * ramp_up_s * np.minimum(a, half)), a + half)


def row_draw(rows: int, n: int, seed: int) -> list[int]:
    """n indices drawn uniformly with replacement from range(rows): a seeded resample of a file's rows.

    Its own stream, apart from the mixed draw's and the arrival gaps', so (n, seed) picks the same rows at every rate.
    """
    if rows < 1:
        raise ValueError(f"there must be at least one row to draw from, got {rows}")
    # Reducing 64-bit words modulo `rows` favours some rows by at most rows / 2**64: no sample can show it.
    return [int(i) for i in _raw(seed, 3, n) % np.uint64(rows)]


def _requests(draw: list[tuple[str, int]], arrivals: list[float]) -> list[Request]:
    return [Request(i, a, PROMPT_LENGTHS[p], b, p) for i, ((p, b), a) in enumerate(zip(draw, arrivals))]


def uniforms(seed: int, stream: int, n: int) -> np.ndarray:
    """n uniforms in (0, 1) from raw words (the same on every NumPy version)."""
    return ((_raw(seed, stream, n) >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53


# Length mixes for synthetic workloads (the sag search): named so a trace can be rebuilt from its metadata.
PROMPT_MIXES = ("five", "loguniform", "bimodal")
BUDGET_MIXES = ("lattice", "uniform", "short", "fixed:N")


def synthetic_lengths(n: int, seed: int, prompts: str, budgets: str) -> list[tuple[int, int]]:
    """n (prompt tokens, budget) pairs. prompts: "five" (the five prompts, uniformly), "loguniform" (16..4096,
    uniform in the logarithm), "bimodal" (16 or 4096, even odds); budgets: "lattice" (64, 128, 192 or 256),
    "uniform" (1..256), "short" (exponential with mean 12, plus 1: code completion's short outputs, capped at 256),
    "fixed:N" (every request N)."""
    u, w = uniforms(seed, 3, n), uniforms(seed, 4, n)
    lengths = list(PROMPT_LENGTHS.values())
    if prompts == "five":
        p = [lengths[int(x * len(lengths))] for x in u]
    elif prompts == "loguniform":
        p = [int(round(16 * 256 ** x)) for x in u]
    elif prompts == "bimodal":
        p = [16 if x < 0.5 else 4096 for x in u]
    else:
        raise ValueError(f"unknown prompt mix {prompts!r}; choose from {', '.join(PROMPT_MIXES)}")
    if budgets == "lattice":
        b = [BUDGETS[int(x * len(BUDGETS))] for x in w]
    elif budgets == "uniform":
        b = [1 + int(x * 256) for x in w]
    elif budgets == "short":
        b = [min(256, 1 + int(-12 * math.log(x))) for x in w]
    elif budgets.startswith("fixed:") and budgets[6:].isdigit() and int(budgets[6:]) >= 1:
        b = [int(budgets[6:])] * n
    else:
        raise ValueError(f"unknown budget mix {budgets!r}; choose from {', '.join(BUDGET_MIXES)}")
    return list(zip(p, b))


def synthetic_trace(rate: float, n: int, seed: int, prompts: str, budgets: str) -> Trace:
    """Poisson arrivals (as poisson_trace's) carrying synthetic_lengths: the same (n, seed, mixes) at every rate."""
    reqs = [Request(i, a, p, b) for i, ((p, b), a) in
            enumerate(zip(synthetic_lengths(n, seed, prompts, budgets), poisson_arrivals(rate, n, seed)))]
    return Trace(reqs, {"kind": "synthetic", "rate": rate, "n": n, "seed": seed, "prompts": prompts, "budgets": budgets})


def check_rate(rate: float) -> float:
    if not (math.isfinite(rate) and rate > 0):
        raise InputError(f"the arrival rate must be a positive number of requests per second, got {rate}")
    return rate


def at_rate(trace: Trace, rate: float) -> Trace:
    """The trace with its time scaled so that it offers `rate` requests per second (same requests, same order)."""
    check_rate(rate)
    if trace.offered_rate is None:
        raise InputError("a trace whose requests all arrive at once cannot be run at a rate")
    scale = trace.offered_rate / rate
    t0 = trace.requests[0].arrival
    reqs = [r.at(round((r.arrival - t0) * scale, ARRIVAL_DECIMALS)) for r in trace.requests]
    return Trace(reqs, {**trace.meta, "rate": rate, "scaled_from": trace.trace_id})


def poisson_trace(rate: float, n: int = DEFAULT_N, seed: int = 0, burstiness: float = 1.0,
                  ramp_up_s: float = 0.0) -> Trace:
    """The seeded arrival trace (rate, n, seed): Poisson arrivals carrying a mixed draw; with burstiness != 1 gamma
    arrivals (kind "gamma"), with ramp_up_s > 0 ramped up (poisson_arrivals). The mixed draw is the same either way."""
    reqs = _requests(mixed_draw(n, seed), poisson_arrivals(rate, n, seed, burstiness, ramp_up_s))
    return Trace(reqs, {"kind": "poisson" if burstiness == 1.0 else "gamma", "rate": rate, "n": n, "seed": seed,
                        **arrival_meta(burstiness, ramp_up_s)})


def arrival_meta(burstiness: float = 1.0, ramp_up_s: float = 0.0) -> dict:
    """The arrival options a trace's metadata names: only those away from their defaults, so a Poisson trace's
    metadata (and file) is what it was before the options existed."""
    return {**({"burstiness": burstiness} if burstiness != 1.0 else {}),
            **({"ramp_up_s": ramp_up_s} if ramp_up_s > 0 else {})}


def closed_mixed(n: int, seed: int = 0) -> Trace:
    """A closed run: the mixed draw (n, seed), everything arriving at t=0."""
    return Trace(_requests(mixed_draw(n, seed), [0.0] * n), {"kind": "closed-mixed", "n": n, "seed": seed})


def closed_uniform(prompt: str, n: int, budget: int = DEFAULT_BUDGET) -> Trace:
    """A closed run of n copies of one prompt and budget, all at t=0."""
    reqs = _requests([(prompt, budget)] * n, [0.0] * n)
    return Trace(reqs, {"kind": "closed-uniform", "prompt": prompt, "budget": budget, "n": n})


def length_trace(requests: list[tuple[float, int, int]], meta: dict | None = None,
                 hash_ids: Sequence[tuple[int, ...]] | None = None, hash_block: int = 0) -> Trace:
    """A trace from (arrival, prompt tokens, budget) triples, e.g. an imported public trace; with `hash_ids`, one
    tuple per request, each request's prompt blocks of hash_block tokens."""
    hashes = [()] * len(requests) if hash_ids is None else hash_ids
    reqs = [Request(i, round(float(a), ARRIVAL_DECIMALS), int(p), int(b), "", tuple(h), hash_block)
            for i, ((a, p, b), h) in enumerate(zip(requests, hashes, strict=True))]
    return Trace(reqs, dict(meta or {}))
