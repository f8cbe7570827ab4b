"""The cost model: the duration of any step shape, from a cost table's fit.

- Prefill (a PrefillShape: each sequence's positions computed, after its prefix in the pool): a smooth surface
  from the engine's two regimes. Small steps are bound by a floor (the host's work per step, graph launch) that
  grows a little with the rows; large ones by the GPU's work, linear in the positions computed and in the
  attention work: g = base + per_token * tokens + per_token2 * attention (+ per_prefix_token2 * the attention over
  K/V read from the pool, where the table prices it apart: a chunk's queries read their prefix through block tables,
  which costs more a unit of work than keys in the step; 32k-token calibrations show it, 4k ones do not; + per_path
  * the longest sequence's context, prefix and positions, where the table measured fused steps: the kernel runs a
  program per query tile, all at once, so a step of few tiles lasts as long as its longest one, whose keys are its
  sequence's whole context, and a fused step's decode rows are each a tile of one query over a long prefix, which
  the sum of tile work alone cannot price). The step
  costs the smooth maximum of
  the two, (floor^k + g^k)^(1/k). Where the table records how the engine rounds a step (its token buckets and
  the prefill kernel's query tile), tokens is the bucket the step runs at, and attention is counted as the
  kernel does it: whole query tiles, each over the prefix and the keys up to the tile's end, plus the bucket's
  padding attending within itself. Older tables price the step's own tokens and causal work.
  The assumption that carries the model to policies a table did not measure: a step's cost depends on its rows,
  the positions it computes and the attention work among them, not on how the rows came to be. A padded group
  of w prompts padded to n is w sequences of n positions; the same prompts at their true lengths (packed) are
  w sequences of n_i; a chunk of c positions of a prompt whose first p are in the pool is one sequence of c
  positions after a prefix of p (attention c * (c + 2p)).
- Fused steps, where the table's engine attends their decode rows with its paged decode kernel
  (engine.mixed_decode_attention == "paged"; the prompt positions go through the prefill kernel in the same forward
  pass): the prefill surface over the step's tokens (its bucket: the decode rows' positions are in every matrix
  product) with the prompt sequences' attention alone, plus per_token * the K/V tokens the decode rows hold, plus a
  fixed part (the decode kernel's launches). A table fitted on such steps has both (fit.prefill.mixed_decode_*).
  One that has not (an engine measured before) derives them, the assumption that carries it: a decode row costs
  a fused step what its K/V read adds to a decode step (the widest measured batch's uniform knots, first to last,
  per row and token), and the launches nothing.
- Decode (rows, K/V tokens, longest row): the step a uniform batch would take at the longest row's length, less
  what the shorter rows save: t = uniform(rows, kv_max) - per_token * (rows * kv_max - kv_tokens), per_token at most
  the steepest uniform segment over the rows (a row a token shorter saves at most a token of a row), and, in tables
  fitted with the floor (fit.decode[backend].floor), never below uniform(rows, kv_tokens // rows): the uniform batch
  that reads as much K/V. The uniform
  cost is interpolated piecewise-linearly in the length through measured knots, per measured row count; row
  counts between measured ones interpolate their neighbours.
- Overhead: the extra cost of a decode step per row it retires (their records are written then).
- Spread: the log-normal sigma of step times around the median, for the simulator's optional noise.
- Serving context (tables with a `correction`, servecap/costs/context.py; none: every step priced as above, nothing
  multiplied): a step of kind k (`prefill POLICY`, `decode BACKEND POLICY`) costs the price above times
  f(k, previous, rows) x (clock_ref / clock) ** e, where each factor is the fitting runs' summed real time over
  their summed price in that class, the 1% at either end of real / model left out (corrections fitted before
  that: the median). The terms, each a factor of its own class:
  previous step: `prefill`, `decode`, `retired` (a decode step that retired rows, so this step starts a new pass
  and pays its host work; where the correction has it, else `decode`), or `idle` (IDLE_S = 20 ms or more with
  nothing running before the step);
  batch: the step's rows in buckets 1, 2-8, 9-16, 17-32, 33+ (host work per step that grows with the batch);
  a decode step's longest row in buckets to 1024, 2048, 3072 and beyond K/V tokens, where the correction has it
  (serving's long-tailed batches leave an error in the decode surface that follows the longest row), each step of
  a stretch in its own;
  a prefill step's size, the positions it computes in buckets to 256, 512, 1024, 2048, 3072 and beyond, where the
  correction has it (the prefill surface, one smooth form over every shape, errs one way on small single prompts
  and the other on large ones, so a factor learnt on one traffic's mix of sizes would not carry to another's);
  chunk steps: the chunked policy's own prefill kind, each step priced at its real prefix by its shape;
  stretch end (an additive term, where the correction has it): a decode step that ends its stretch costs s(k, n)
  seconds more, n its stretch's steps in buckets to 2, 4, 8, 16, 32 and beyond (the host's work when a stretch
  ends, which the device waits for; fitted on stretches of two steps or more, a one-step stretch's end not being
  told apart from its first step's context);
  SM clock: (clock_ref / clock) ** e where the fitting runs recorded telemetry, e fitted on the residuals; where
  the clock is not known (the simulator) the factor is 1, i.e. the runs' median clock.
  The step loop's previous step and idle gap reach the simulator through its timer (servecap/sim/simulator.py), which sees
  every step in order; pricing a recorded step (servecap/calibrate/from_runs.py, validate) reads them from the record.
"""
from __future__ import annotations

import math
import warnings
from bisect import bisect_left
from functools import lru_cache
from pathlib import Path

import numpy as np

from servecap.traces.errors import InputError

from .context import Correction, decode_kind, kv_class_end, prefill_kind, total_kv_class_end
from .shapes import PrefillShape, backend_named
from .table import (MIXED_FIXED_PARAM, MIXED_PER_TOKEN_PARAM, PATH_PARAM, PREFILL_PARAMS, PREFIX_PARAM, CostTable,
                    as_cost_table, decode_rows_apart, table_id)


class ExtrapolationWarning(UserWarning):
    pass


def _whole(x) -> int:
    """A K/V token count: a whole number (given as an int or a float)."""
    if x != int(x):
        raise ValueError(f"a K/V token count must be a whole number, got {x!r}")
    return int(x)


def prefill_time(params, rows, tokens, span, prefix=0.0):
    """The fitted prefill surface (numbers or numpy arrays); params in PREFILL_PARAMS order. `prefix`: the step's
    priced attention over K/V read from the pool (tables that price it apart; 0 leaves the older sum as it was)."""
    floor_s, floor_per_row_s, base_s, per_token_s, per_token2_s, k = params
    gpu = base_s + per_token_s * tokens + per_token2_s * tokens * span + prefix
    floor = floor_s + floor_per_row_s * rows
    top = np.maximum(floor, gpu)  # scaled by the larger term so that no power overflows
    return top * ((floor / top) ** k + (gpu / top) ** k) ** (1 / k)


def longest_context(shape: PrefillShape) -> int:
    """The keys the step's longest-running attention program reads: its longest sequence's prefix and positions."""
    return max((p + n for n, p in zip(shape.computed, shape.prefix)), default=0)


def tile_work(n: int, prefix: int, block_m: int) -> int:
    """Attention work of n query positions after `prefix` as the prefill kernel does it: ceil(n / block_m) query
    tiles of block_m rows, tile j over the prefix and the keys up to its end (counted twice, as PrefillShape.attn)."""
    t = -(-n // block_m)
    return 2 * block_m * (t * prefix + block_m * t * (t - 1) // 2 + n)


class PrefillRounding:
    """How an engine runs a prefill step: the token buckets it rounds a step up to, and its query tile."""

    def __init__(self, engine: dict | None):
        engine = engine or {}
        self.buckets = np.asarray(engine.get("prefill_buckets") or [], dtype=np.int64)
        self.block_m = engine.get("prefill_block_m")

    @property
    def known(self) -> bool:
        return self.buckets.size > 0 and bool(self.block_m)

    def split(self, shape: PrefillShape, attended: PrefillShape | None = None) -> tuple[int, float, float]:
        """(tokens, attention work per token within the step's sequences, per token over their prefixes in the
        pool): features() with the prefix's part apart (a query tile's keys from the pool, 2 * block_m * p each).
        `attended`: the sequences the prefill kernel attends, where not all of the step's (a fused step whose
        decode rows the decode kernel attends: their positions count, their attention does not)."""
        attended = shape if attended is None else attended
        tokens, span = self.features(shape, attended)
        if self.known:
            t = [-(-n // self.block_m) for n in attended.computed]
            prefix = sum(2 * self.block_m * k * p for k, p in zip(t, attended.prefix))
        else:
            prefix = sum(2 * n * p for n, p in zip(attended.computed, attended.prefix))
        return tokens, span - prefix / tokens, prefix / tokens

    def bucket(self, tokens):
        """The token count a step of `tokens` runs at (an int; or an array of them, for an array): its bucket, or
        itself past the last bucket or where the table does not record the engine's rounding."""
        b = self.buckets
        i = np.searchsorted(b, tokens)
        if np.ndim(tokens) == 0:  # the simulator's path, once a prefill step
            return int(b[i]) if i < b.size else int(tokens)
        return np.where(i < b.size, b[np.minimum(i, b.size - 1)], tokens) if b.size else np.asarray(tokens)

    def features(self, shape: PrefillShape, attended: PrefillShape | None = None) -> tuple[int, float]:
        """(tokens, attention work per token) the fitted surface takes for this step (`attended`: as for split)."""
        attended = shape if attended is None else attended
        if not self.known:  # a table from before the engine recorded its rounding: the step's own work
            return shape.tokens, attended.attn / shape.tokens
        tokens = shape.tokens
        bucket = self.bucket(tokens)
        work = sum(tile_work(n, p, self.block_m) for n, p in zip(attended.computed, attended.prefix))
        work += tile_work(bucket - tokens, 0, self.block_m) if bucket > tokens else 0
        return bucket, work / bucket


def interp(knots: list[list[float]], length):
    """Piecewise-linear in the length through the knots, extended along the end segments."""
    return _interp(np.array([k[0] for k in knots], float), np.array([k[1] for k in knots], float), length)


def _interp(x: np.ndarray, y: np.ndarray, length, min_slope: float = 0.0, floor_from: float = math.inf):
    """interp; past the last knot the end segment's slope, and past `floor_from` (the table's own range) never
    below `min_slope` (a decode step's K/V reads: a noisy last segment must not carry the cost down, or below zero,
    at lengths the table never measured)."""
    if len(x) == 1:
        return np.full_like(np.asarray(length, float), y[0])
    length = np.asarray(length, float)
    lo = y[0] + (length - x[0]) * (y[1] - y[0]) / (x[1] - x[0])
    slope = (y[-1] - y[-2]) / (x[-1] - x[-2])
    hi = y[-1] + (length - x[-1]) * slope
    if min_slope > slope and floor_from < math.inf:  # inf - inf below would be nan, a warning for nothing
        edge = max(floor_from, x[-1])
        hi = np.where(length > edge, y[-1] + (edge - x[-1]) * slope + (length - edge) * min_slope, hi)
    return np.where(length < x[0], lo, np.where(length > x[-1], hi, np.interp(length, x, y)))


class _Knots:
    """One row count's knots, read from the table once; and interp at every whole length up to the longest asked
    for so far, as Python floats, so that pricing a stretch of decode steps looks its lengths up instead of calling
    numpy (whose per-call overhead is most of the cost of a stretch of a few steps). The values are interp's own,
    computed by it on arrays, so a lookup equals interp at that length to the bit."""

    def __init__(self, knots: list[list[float]], min_slope: float = 0.0, floor_from: float = math.inf):
        self.x = np.array([k[0] for k in knots], float)
        self.y = np.array([k[1] for k in knots], float)
        self.min_slope, self.floor_from = min_slope, floor_from
        self._at: list[float] = []  # interp at lengths 0, 1, 2, ...

    def upto(self, end: int) -> list[float]:
        """interp at lengths 0, 1, ..., at least up to end - 1."""
        if end > len(self._at):  # grown by doubling: a run asks for a few thousand lengths in all
            new = np.arange(len(self._at), max(end, 2 * len(self._at), 1024)).astype(float)
            self._at += _interp(self.x, self.y, new, self.min_slope, self.floor_from).tolist()
        return self._at


class _DecodeFit:
    """One backend's decode fit, read from the table once (not on every step)."""

    def __init__(self, d: dict, max_tokens: float = math.inf):
        self.rows: list[int] = d["rows"]
        self.per_token = [float(v) for v in d["per_token_s"]]
        # Past the table's range a uniform step grows at least by its rows' K/V reads (rows * per_token a token of
        # length), the fit's own marginal cost.
        self.knots = [_Knots(ks, max(0.0, p) * r, max_tokens) for ks, p, r in zip(d["knots"], self.per_token,
                                                                                self.rows)]
        self.top = max(k[-1][0] for k in d["knots"])  # the longest length measured at any row count
        self.floored = d.get("floor") == "uniform-mean"
        self.weights: dict[int, tuple] = {}  # rows -> how decode() weighs the measured row counts (row_weights)

    def row_weights(self, rows: int) -> tuple:
        """(i, None, None) for a measured row count i, whose neighbour has weight 0 (x * 0.0 adds nothing to a
        duration: at most the sign of a zero one, which no end time can show); else (i, 1 - w, w): decode()'s
        at(i - 1) * (1 - w) + at(i) * w. Computed once per row count."""
        r = self.rows
        if len(r) == 1:
            return 0, None, None
        i = min(max(bisect_left(r, rows), 1), len(r) - 1)  # decode()'s np.clip(np.searchsorted(...)) on a list
        if rows == r[i] or rows == r[i - 1]:
            return (i if rows == r[i] else i - 1), None, None
        w = (rows - r[i - 1]) / (r[i] - r[i - 1])
        return i, 1 - w, w


def kv_read_per_token(decode: dict) -> float:
    """What a K/V token's read adds to a decode step, from a decode fit (fit.decode[backend]): the widest measured
    batch's uniform knots, first to last, per row and token of length (the least noisy slope a table has: small
    batches' steps are bound by launches, their K/V reads lost in the noise)."""
    knots, rows = decode["knots"][-1], decode["rows"][-1]
    (x0, y0), (x1, y1) = knots[0], knots[-1]
    return max(0.0, (y1 - y0) / (rows * (x1 - x0))) if x1 > x0 else 0.0


def mixed_decode_terms(table: CostTable) -> tuple[float, float] | None:
    """(per K/V token, fixed seconds) a fused step pays for its decode rows where the table's engine attends them
    with its paged decode kernel (engine.mixed_decode_attention == "paged"); None where it does not. Fitted from the
    table's fused points where it has them (fit.prefill.mixed_decode_*), else derived: each row's K/V read costs
    what it adds to a decode step (kv_read_per_token of the paged fit), and the kernel's launches nothing."""
    if not decode_rows_apart(table.raw.get("engine")):
        return None
    p = table.fit["prefill"]
    per_token = p.get(MIXED_PER_TOKEN_PARAM)
    if per_token is None:
        per_token = kv_read_per_token(table.fit["decode"]["paged"])
    return float(per_token), float(p.get(MIXED_FIXED_PARAM, 0.0))


def prefill_ranges(table: CostTable) -> dict[str, list[float]]:
    """The measured range of rows, tokens and span, read from either table version's fit."""
    p = table.fit["prefill"]
    if "widths" in p:  # version 1: padded groups, width x padded length
        (w0, w1), (n0, n1) = p["widths"], p["lengths"]
        return {"rows": [w0, w1], "tokens": [w0 * n0, w1 * n1], "span": [n0, n1]}
    return {k: p[k] for k in ("rows", "tokens", "span")}


_POSITIVE: set[str] = set()  # ids of the tables whose fitted steps were found positive in this process


class CostModel:
    """Step durations in seconds from a checked cost table's fit; a table whose fitted steps are not positive
    durations over its own range is refused (checked once a process: a sweep builds a model per worker)."""

    def __init__(self, table: CostTable | dict, strict: bool = False):
        if isinstance(table, dict):  # a table's JSON object (synthetic, or edited in memory): identified by its
            # content and checked here; whether to trust a failed stationarity check is the loader's question
            table = as_cost_table({**table, "table_id": table_id(table)}, allow_nonstationary=True)
        self.table = table
        self.strict = False  # check_positive looks past the measured range on purpose
        p = table.fit["prefill"]
        self._prefill_params = tuple(p[k] for k in PREFILL_PARAMS)
        self._per_prefix = p.get(PREFIX_PARAM)  # None: prefix attention priced as the rest (older tables)
        self._per_path = p.get(PATH_PARAM)  # None: no critical-path term (tables without fused steps)
        # (per K/V token, fixed) of a fused step's decode rows attended by the decode kernel; None: an engine whose
        # fused steps run their decode rows through the prefill kernel, priced as the prefill step it is.
        self._mixed = mixed_decode_terms(table)
        self._ranges = prefill_ranges(table)
        self.rounding = PrefillRounding(table.raw.get("engine"))
        self.prefill_sigma = p["sigma"]
        decode = table.fit["decode"]
        self._decode = {b: _DecodeFit(d, table.max_tokens or math.inf) for b, d in decode.items()}
        self.decode_sigma = {b: d["sigma"] for b, d in decode.items()}
        self.retire_s = table.retire_s
        self.correction = Correction(table.correction) if table.correction else None
        self.backends = tuple(decode)
        self._warned: set[str] = set()  # which extrapolations were warned about
        self._prefill = lru_cache(maxsize=65536)(self._prefill_cost)
        tid = table.raw.get("table_id")  # a table still being built (calibration) has none yet
        if tid is None or tid not in _POSITIVE:
            self.check_positive(table.path)
            if tid is not None:
                _POSITIVE.add(tid)
        self.strict, self._warned = strict, set()  # the check's look past the range is not the run's
        for d in self._decode.values():  # nor are the row counts it priced: a run's first stretch at each warns
            d.weights.clear()

    def _outside(self, what: str) -> None:
        if self.strict:
            raise InputError(f"{what} is outside the cost table's measured range (strict mode)")
        key = what.split(" ")[0]
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"{what} is outside the cost table's measured range; extrapolating "
                          f"(the fitted model's own form)", ExtrapolationWarning, stacklevel=4)

    def prefill(self, shape: PrefillShape) -> float:
        """One prefill step of this shape, as the table's closed runs measured it (no serving context)."""
        return self._prefill(shape)

    def factor(self, kind: str, prev_kind: str | None, idle_s: float, rows: int,
               clock_mhz: float | None = None, tokens: int | None = None) -> float:
        """The serving-context multiplier of one step (module docstring); 1 with no correction."""
        if self.correction is None:
            return 1.0
        return self.correction.factor(kind, prev_kind, idle_s, rows, clock_mhz, tokens=tokens)

    def prefill_in_context(self, shape: PrefillShape, policy: str, prev_kind: str | None, idle_s: float,
                           clock_mhz: float | None = None) -> float:
        """One prefill step as serving pays it: after a step of `prev_kind` (None: the first), `idle_s` after it."""
        d = self._prefill(shape)
        if self.correction is None:
            return d
        return d * self.correction.factor(prefill_kind(policy), prev_kind, idle_s, shape.rows, clock_mhz,
                                          tokens=shape.tokens)

    def stretch_end_s(self, backend: str, policy: str, steps: int) -> float:
        """What the end of a stretch of `steps` decode steps adds to its last step under `policy` (module docstring);
        0 with no correction."""
        if self.correction is None:
            return 0.0
        return self.correction.stretch_end(decode_kind(backend, policy), steps)

    def _prefill_cost(self, shape: PrefillShape) -> float:
        rows, tokens, span = shape.rows, shape.tokens, shape.span
        r = self._ranges
        if rows > r["rows"][1] or tokens > r["tokens"][1] or span > r["span"][1]:
            self._outside(f"prefill of {rows} rows x {tokens} tokens (span {span:.0f})")
        split = self._mixed is not None and shape.decode > 0
        attended = shape.prompts if split else shape
        if self._per_prefix is None:
            cost = float(prefill_time(self._prefill_params, rows, *self.rounding.features(shape, attended)))
        else:
            tokens, own, prefix = self.rounding.split(shape, attended)
            pool = self._per_prefix * tokens * prefix
            if self._per_path is not None:
                pool += self._per_path * longest_context(attended)
            cost = float(prefill_time(self._prefill_params, rows, tokens, own, pool))
        if split:  # the decode kernel's part: its rows' K/V reads and its launches
            per_token, fixed = self._mixed
            cost += fixed + per_token * shape.decode_kv
        return cost

    def _fit(self, backend: str) -> _DecodeFit:
        d = self._decode.get(backend_named(backend))  # a record or command may give the backend's old name
        if d is None:
            raise InputError(f"the cost table has no decode costs for backend {backend!r} "
                             f"(it has {', '.join(self.backends)})")
        return d

    def decode(self, backend: str, rows: int, kv_tokens, kv_max):
        """One decode step of `rows` rows holding `kv_tokens` K/V tokens in all, `kv_max` in the longest (whole
        numbers, or arrays of them): decode_stretch's price of a one-step stretch at each, so that there is one
        decode cost."""
        kt, km = np.broadcast_arrays(np.asarray(kv_tokens), np.asarray(kv_max))
        got = [self.decode_stretch(backend, rows, _whole(a), _whole(b), 1)[0]
               for a, b in zip(kt.ravel().tolist(), km.ravel().tolist())]
        return np.asarray(got, float).reshape(kt.shape) if kt.ndim else got[0]

    def decode_stretch(self, backend: str, rows: int, kv_tokens: int, kv_max: int, k: int) -> list[float]:
        """k consecutive decode steps of the same rows from this shape, each row one token longer a step, as the
        table's closed runs measured them: decode_stretch_in_context with no serving context."""
        return self.decode_stretch_in_context(backend, rows, kv_tokens, kv_max, k, None, None, 0.0)

    def decode_stretch_in_context(self, backend: str, rows: int, kv_tokens: int, kv_max: int, k: int,
                                  policy: str | None, prev_kind: str | None, idle_s: float) -> list[float]:
        """k consecutive decode steps of the same rows from this shape, each row one token longer a step, as serving
        under `policy` pays them: the first after a step of `prev_kind`, `idle_s` after it, the others each right
        after a decode step. With no correction, or no policy (no serving context), the closed runs' prices.

        The uniform cost at the longest row, less what the shorter rows save (per_token * (rows * kv_max -
        kv_tokens), the same at every step); between two measured row counts their two predictions weighed; past
        the widest, the line through the last two, never below the last. Interp is looked up (_Knots), in plain
        Python: the simulator prices every stretch with it (in one call: a stretch is a few steps on average), and
        numpy's per-call overhead would be most of the cost (tests/test_fast_paths.py holds it to numpy's
        arithmetic)."""
        try:
            d = self._decode[backend]
        except KeyError:
            d = self._fit(backend)  # raises, naming the backends there are
        weights = d.weights.get(rows)
        if weights is None:  # the first stretch at this row count (later ones could only repeat its warning)
            if rows > d.rows[-1] or rows < d.rows[0]:
                self._outside(f"decode rows {rows}")
            weights = d.weights[rows] = d.row_weights(rows)
        end = kv_max + k
        if end - 1 > 1.05 * d.top:
            self._outside(f"decode K/V of {end - 1} tokens in the longest row")
        # decode()'s rows * kv_max - kv_tokens: the same at every step, and exact in floats as in integers (whole
        # numbers far below 2**53), so computed once, here in integers.
        short = float(rows * kv_max - kv_tokens)
        i, u, w = weights
        b, cb = d.knots[i].upto(end), d.per_token[i] * short
        a, ca = (d.knots[i - 1].upto(end), d.per_token[i - 1] * short) if u is not None else (b, cb)
        if u is None:
            steps = [y - cb for y in b[kv_max:end]]
        elif rows > d.rows[-1]:  # decode()'s floor past the widest measured batch: never below the last row count
            steps = [max((x - ca) * u + (y - cb) * w, y - cb) for x, y in zip(a[kv_max:end], b[kv_max:end])]
        else:
            steps = [(x - ca) * u + (y - cb) * w for x, y in zip(a[kv_max:end], b[kv_max:end])]
        if d.floored and short:
            # Never below a uniform batch of the same rows holding as much K/V (its rows at the mean length,
            # floored): the same reads, spread evenly. A saving fitted at short contexts must not carry one long row
            # beside many short ones below it (at 32 rows and 32k it went below zero).
            mean = kv_tokens // rows
            lo = b[mean:mean + k] if u is None else [x * u + y * w for x, y in zip(a[mean:mean + k], b[mean:mean + k])]
            steps = [max(t, f) for t, f in zip(steps, lo)]
        c = self.correction
        if c is None or policy is None:
            return steps
        kind = decode_kind(backend, policy)
        first = steps[0] * c.factor(kind, prev_kind, idle_s, rows, kv_max=kv_max, kv_tokens=kv_tokens)
        if not c.by_kv:
            rest = c.factor(kind, "decode", 0.0, rows)
            return [first] + [x * rest for x in steps[1:]]
        # Step j's longest row is kv_max + j and its K/V in all kv_tokens + rows * j: the stretch's steps after the
        # first change factor where either crosses into its next class.
        out, j = [first], 1
        while j < len(steps):
            n, end = len(steps), kv_class_end(kv_max + j)
            if end != math.inf:
                n = min(n, end - kv_max + 1)
            total = kv_tokens + rows * j
            if c.by_total and (total_end := total_kv_class_end(total)) != math.inf:
                n = min(n, (total_end - kv_tokens) // rows + 1)
            rest = c.factor(kind, "decode", 0.0, rows, kv_max=kv_max + j, kv_tokens=total)
            out += [x * rest for x in steps[j:n]]
            j = n
        return out

    def check_positive(self, path: Path | None = None) -> None:
        """Refuse a table whose fitted steps are not positive, finite durations over its own range."""
        t = self.table
        lengths = np.unique(np.geomspace(1, t.max_tokens, 24).round())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ExtrapolationWarning)
            for b in self.backends:
                for rows in range(1, t.max_batch + 1):
                    for kv_tokens in (lengths + rows - 1, rows * lengths):  # one long row and short ones; uniform
                        d = np.asarray(self.decode(b, rows, kv_tokens, lengths))
                        if not np.all(np.isfinite(d) & (d > 0)):
                            bad = int(lengths[np.argmin(np.where(np.isfinite(d), d, -np.inf))])
                            raise InputError(f"its fitted {b} decode step is not a positive duration at {rows} rows "
                                             f"with a longest row of {bad} tokens: the fit is broken", path=path)
            for rows in (1, t.max_batch):
                for n in (1, t.max_tokens):
                    d = self._prefill_cost(PrefillShape.padded(rows, n))
                    if not (math.isfinite(d) and d > 0):
                        raise InputError(f"its fitted prefill of {rows} x {n} tokens is not a positive duration",
                                         path=path)
