"""The serving-context correction: what a step costs in a serving run over what the cost table's closed runs say
it costs at the same shape, as multiplicative factors per (step kind, context class), fitted from real run records
(`python -m calibrate --from-runs`, servecap/calibrate/from_runs.py) and stored in the table (version 3, `correction`).

A step's kind is `prefill POLICY` or `decode BACKEND POLICY`; its context class is made of the terms below, each a
few discrete levels, so that a factor is a ratio over many steps (summed real over summed model, trimmed; a
median in corrections fitted before), not a fitted curve:
- the previous step: `prefill` (a decode step right after a prefill pays for it: 1.09-1.13x in issue 21's runs),
  `decode`, `retired` (a decode step that retired rows: the step after it starts a new pass, whose host work, the
  scheduler's and the first launch of a decode stretch, the device waits for; where the correction was fitted with
  it, else `decode`), or `idle` (the first step after IDLE_S or more with nothing running, or the first of a run);
- the batch: the step's rows in ROW_BUCKETS (host work per step that grows with the batch);
- a decode step's longest row, its K/V tokens in KV_BUCKETS (the decode surface interpolates a uniform batch at the
  longest row less what the shorter rows save; serving's batches of long-tailed rows leave an error that follows
  the longest row), where the correction was fitted with it (older corrections have no such keys);
- and within that, its K/V tokens in all, in TOTAL_KV_BUCKETS: in serving, batches of many long rows cost less
  over the table's price than batches with the same longest row and less K/V in all, most right after a chunk
  (validation v15's chunked:512 ShareGPT point), so a factor learnt on short traffic over-prices long traffic;
  where the correction was fitted with it;
- a prefill step's size, the positions it computes in TOKEN_BUCKETS (the prefill surface is one smooth form over
  every shape: on a single prompt it errs one way at a few hundred positions and the other way at a few thousand,
  so a class factor learnt on one traffic's mix of sizes does not carry to another's), where the correction was
  fitted with it;
- (a class's median real / model, `median`, beside its factor where the correction was fitted with it: a typical
  step's price, which a per-step median is graded against; in serving the ratios are skewed, so the median sits
  1-2% under the summed ratio, and the simulator prices by the factor, since runs and queues add steps up);
- the SM clock, where the runs recorded telemetry: factor (reference / clock) ** exponent, the exponent fitted on
  the residuals, the reference the median clock of the fitting runs; the simulator, which has no clock, prices at
  the reference (the sustained clock the runs saw), and pricing a recorded step with its clock uses its clock.
- the stretch's end, where the correction was fitted with it: a decode step that ends its stretch (the pass after it
  computes a prompt, admits, preempts, or its rows retired) holds the engine's host work at that end (reading the
  stretch's tokens, retirement, the next plan) while the device waits: an additive term in seconds, not a factor,
  since it does not scale with the step, by the stretch's length in STRETCH_BUCKETS (it grows with the length:
  results/calibration/t10/from-runs-v26.txt). A one-step stretch shares the two-step class and is fitted
  from none: its only step is also its first, whose cost after a prefill or a retirement the previous-step factor
  holds, and the two cannot be told apart on it. The step loop charges it where the stretch ends
  (servecap/core/step_loop.py), so fast-forward and stepping charge it alike; a class with fewer than `min_steps`
  fitted ends falls back to the kind, the backend across policies, and to 0.
Chunk steps are priced at their real prefix by the shape itself (servecap/costs/shapes.py); their factor is the chunked
policy's prefill kind. A class with fewer than `min_steps` fitted steps falls back to the next coarser key
(kind|previous|rows|longest row|K/V in all, kind|previous|rows|longest row for decode or |size for prefill,
kind|previous|rows, kind|previous, kind, and for decode the backend across policies), and to 1.

`scale` multiplies every step and stretch end: the prediction intervals' sampled cost draw (servecap/sim/intervals.py),
one factor, or an object of factors by step kind with `all` for the kinds it does not name (a decode stretch's end
takes its decode kind's).

A table with no correction prices every step exactly as before: the factor is 1 and is never multiplied in.
"""
from __future__ import annotations

import math
import re
from bisect import bisect_left

from .shapes import backend_named

IDLE_S = 0.02  # seconds with nothing running after which a step counts as the first after idle
ROW_BUCKETS = (1, 8, 16, 32)  # rows up to each bound share a class; more than the last, one more
KV_BUCKETS = (1024, 2048, 3072)  # a decode step's longest row (K/V tokens) up to each bound shares a class
TOTAL_KV_BUCKETS = (49152,)  # a decode step's K/V tokens in all (every row's) up to each bound share a class
TOKEN_BUCKETS = (256, 512, 1024, 2048, 3072)  # a prefill step's positions computed up to each bound share a class
STRETCH_BUCKETS = (2, 4, 8, 16, 32)  # a stretch's decode steps up to each bound share a stretch-end class
MIN_STEPS = 30


RETIRED = "retired"  # the previous step's kind where it was a decode step that retired rows
ALL = "all"  # a scale object's factor for the kinds it does not name
PREFILL = "prefill"  # the refresh kind of every step that computes prompt positions (speed_kind)


def previous(prev_kind: str | None, idle_s: float, threshold: float = IDLE_S) -> str:
    """The previous-step term: idle after `threshold` with nothing running (or at a run's start), else its kind."""
    return "idle" if prev_kind is None or idle_s >= threshold else prev_kind


def rows_class(rows: int) -> str:
    lo = 1
    for hi in ROW_BUCKETS:
        if rows <= hi:
            return f"r{lo}-{hi}" if hi > lo else f"r{hi}"
        lo = hi + 1
    return f"r{lo}+"


def kv_index(kv_max: int) -> int:
    """kv_max's class: the first bound of KV_BUCKETS it is within (len(KV_BUCKETS) past the last)."""
    return bisect_left(KV_BUCKETS, kv_max)


def _bucket(bounds: tuple[int, ...], i: int, tag: str) -> str:
    lo = bounds[i - 1] + 1 if i else 1
    return f"{tag}{lo}-{bounds[i]}" if i < len(bounds) else f"{tag}{lo}+"


def _end(bounds: tuple[int, ...], i: int) -> float:
    """Where class i of `bounds` ends (inf for the last)."""
    return bounds[i] if i < len(bounds) else math.inf


def kv_class(kv_max: int) -> str:
    return _bucket(KV_BUCKETS, kv_index(kv_max), "k")


def total_kv_index(kv_tokens: int) -> int:
    return bisect_left(TOTAL_KV_BUCKETS, kv_tokens)


def total_kv_class(kv_tokens: int) -> str:
    return _bucket(TOTAL_KV_BUCKETS, total_kv_index(kv_tokens), "K")


def total_kv_class_end(kv_tokens: int) -> float:
    """The K/V tokens in all at which kv_tokens's class ends (inf for the last)."""
    return _end(TOTAL_KV_BUCKETS, total_kv_index(kv_tokens))


def tokens_class(tokens: int) -> str:
    return _bucket(TOKEN_BUCKETS, bisect_left(TOKEN_BUCKETS, tokens), "t")


def kv_class_end(kv_max: int) -> float:
    """The longest row at which kv_max's class ends (inf for the last)."""
    return _end(KV_BUCKETS, kv_index(kv_max))


def prefill_kind(policy: str) -> str:
    return f"prefill {policy.partition(':')[0]}"


def decode_kind(backend: str, policy: str) -> str:
    return f"decode {backend} {policy.partition(':')[0]}"


def keys(kind: str, prev: str, rows: int, kv_max: int | None = None, tokens: int | None = None,
         kv_tokens: int | None = None) -> list[str]:
    """The factor keys of one step, most specific first (a decode step's longest row where kv_max is given, and its
    K/V in all within it where kv_tokens is too; a prefill step's size where tokens is)."""
    out = [f"{kind}|{prev}|{rows_class(rows)}", f"{kind}|{prev}", kind]
    if kind.startswith("decode "):
        if kv_max is not None:
            out.insert(0, f"{out[0]}|{kv_class(kv_max)}")
            if kv_tokens is not None:
                out.insert(0, f"{out[0]}|{total_kv_class(kv_tokens)}")
        out.append(speed_kind(kind))  # the backend across policies
    elif tokens is not None:
        out.insert(0, f"{out[0]}|{tokens_class(tokens)}")
    return out


def stretch_class(steps: int) -> str:
    return _bucket(STRETCH_BUCKETS, bisect_left(STRETCH_BUCKETS, steps), "s")


def stretch_end_keys(kind: str, steps: int) -> list[str]:
    """The stretch-end keys of a decode kind's stretch of `steps` steps, most specific first."""
    return [f"{kind}|{stretch_class(steps)}", kind, speed_kind(kind)]


def speed_kind(kind: str) -> str:
    """A step kind's refresh kind, the level a GPU's serving speed is read at (servecap/calibrate/speed.py): `decode
    BACKEND` across policies, `prefill` for every step that computes prompt positions."""
    return " ".join(kind.split(" ")[:2]) if kind.startswith("decode ") else PREFILL


def current_kind(key: str) -> str:
    """A factor key under its decode backend's current name: corrections fitted before the rename say `padded`."""
    return re.sub(r"^decode ([\w-]+)", lambda m: f"decode {backend_named(m.group(1))}", key)


class Correction:
    """A table's correction section, read once; factor() is the multiplier of one step."""

    def __init__(self, raw: dict):
        self.raw = raw
        self.min_steps = int(raw.get("min_steps", MIN_STEPS))
        self.idle_s = float(raw.get("idle_s", IDLE_S))
        kept = {current_kind(k): v for k, v in raw["factors"].items() if v["n"] >= self.min_steps}
        self.factors = {k: float(v["factor"]) for k, v in kept.items()}
        self.medians = {k: float(v.get("median", v["factor"])) for k, v in kept.items()}
        self.by_kv = any(k.count("|") >= 3 for k in self.factors if k.startswith("decode "))  # the longest-row term
        self.by_total = any(k.count("|") == 4 for k in self.factors if k.startswith("decode "))  # the K/V in all
        self.by_tokens = any(k.count("|") == 3 for k in self.factors if k.startswith("prefill "))  # the size term
        self.by_retired = any(f"|{RETIRED}" in k for k in self.factors)  # fitted with the pass-start term
        scale = raw.get("scale", 1.0)
        self.scale = {current_kind(k): float(v) for k, v in scale.items()} if isinstance(scale, dict) else \
            {ALL: float(scale)}
        clock = raw.get("clock") or {}
        self.clock_ref, self.clock_exp = clock.get("reference_mhz"), clock.get("exponent")
        self._cache: dict[tuple, float] = {}
        ends = (raw.get("stretch_end") or {}).get("ends", {})
        self.ends = {current_kind(k): float(v["s"]) for k, v in ends.items() if v["n"] >= self.min_steps}
        self._end_cache: dict[tuple[str, int], float] = {}

    def factor(self, kind: str, prev_kind: str | None, idle_s: float, rows: int,
               clock_mhz: float | None = None, kv_max: int | None = None, tokens: int | None = None,
               typical: bool = False, kv_tokens: int | None = None) -> float:
        """kv_max: a decode step's longest row, kv_tokens its K/V tokens in all; tokens: a prefill step's positions
        computed (each ignored for the other kind of step, and where the correction has no such term). `typical`:
        the class's median instead of its summed ratio (where the correction has medians, else the same)."""
        prev = previous(prev_kind, idle_s, self.idle_s)
        if prev == RETIRED and not self.by_retired:
            prev = "decode"
        decode = kind.startswith("decode ")
        kv = kv_index(kv_max) if self.by_kv and kv_max is not None and decode else None
        size = tokens_class(tokens) if self.by_tokens and tokens is not None and not decode else None
        total = total_kv_index(kv_tokens) if self.by_total and kv is not None and kv_tokens is not None else None
        key = (kind, prev, rows, kv, size, total, typical)
        f = self._cache.get(key)
        if f is None:
            found = keys(kind, prev, rows, None if kv is None else kv_max, None if size is None else tokens,
                         None if total is None else kv_tokens)
            by = self.medians if typical else self.factors
            f = self._cache[key] = self.scale_of(kind) * next((by[k] for k in found if k in by), 1.0)
        if clock_mhz is not None and self.clock_exp is not None and math.isfinite(clock_mhz) and clock_mhz > 0:
            f *= (self.clock_ref / clock_mhz) ** self.clock_exp
        return f

    def stretch_end(self, kind: str, steps: int) -> float:
        """Seconds the engine's host work holds a decode stretch of `steps` steps of this kind at its end (0 where
        the correction was fitted without the term)."""
        if not self.ends:
            return 0.0
        key = (kind, steps)
        s = self._end_cache.get(key)
        if s is None:
            s = self._end_cache[key] = self.scale_of(kind) * next(
                (self.ends[k] for k in stretch_end_keys(kind, steps) if k in self.ends), 0.0)
        return s

    def scale_of(self, kind: str) -> float:
        """The interval's cost draw on a step of this kind."""
        return self.scale.get(kind, self.scale.get(ALL, 1.0))


def check_correction(c, path, error) -> None:
    """The correction section's structure; `error(message)` raises the table's InputError."""
    if not isinstance(c, dict) or not isinstance(c.get("factors"), dict):
        error("correction must be an object with factors")
    def positive(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0
    for k, v in c["factors"].items():
        if not (isinstance(v, dict) and positive(v.get("factor")) and positive(v.get("median", 1))
                and isinstance(v.get("n"), int) and v["n"] >= 0):
            error(f"correction.factors[{k!r}] needs a positive factor (and median, where given) and a step count "
                  f"n, got {v!r}")
    scale = c.get("scale", 1.0)
    if not (positive(scale) or isinstance(scale, dict) and scale and all(positive(v) for v in scale.values())):
        error(f"correction.scale must be a positive number or an object of them by step kind, got {scale!r}")
    ends = c.get("stretch_end")
    if ends is not None:
        if not isinstance(ends, dict) or not isinstance(ends.get("ends"), dict):
            error("correction.stretch_end must be an object with ends")
        for k, v in ends["ends"].items():
            if not (isinstance(v, dict) and isinstance(v.get("s"), (int, float)) and not isinstance(v["s"], bool)
                    and math.isfinite(v["s"]) and v["s"] >= 0 and isinstance(v.get("n"), int) and v["n"] >= 0):
                error(f"correction.stretch_end.ends[{k!r}] needs seconds s of 0 or more and a count n, got {v!r}")
    clock = c.get("clock")
    if clock is not None and not (isinstance(clock, dict) and clock.get("reference_mhz", 0) > 0
                                  and isinstance(clock.get("exponent"), (int, float))):
        error("correction.clock needs reference_mhz > 0 and an exponent")
