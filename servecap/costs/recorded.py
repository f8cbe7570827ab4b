"""A run record's steps beside the cost model's price for each, at its shape and in its serving context.

One row per recorded step whose shape the record determines: its kind (servecap/costs/context.py), the previous
step's kind (`retired` for a decode step that retired rows) and the idle gap before it (per replica, in the record's
order), its rows, longest row and positions computed, the time it held the engine (held_s), the table's price at
the shape, retirement's overhead for the rows that retire after it (apart: the simulator adds it unscaled by any
context factor), the steps of the decode stretch it ends (stretch_ends; 0 where it ends none) and, where the run
recorded GPU telemetry, the SM clock at its start.
servecap/calibrate/from_runs.py fits the correction on these and grades it (contextual: the price with a
correction's factors). Torch-free (pandas).
"""
from __future__ import annotations

import math

import numpy as np

from .context import RETIRED, decode_kind, prefill_kind
from .model import CostModel
from .shapes import PrefillShape

COLUMNS = ("replica", "start", "step_kind", "kind", "rows", "kv_max", "kv_tokens", "tokens", "prev_kind", "idle_s",
           "real_s", "model_s", "retire_s", "stretch_end", "clock_mhz")


def prefill_shape(row, groups: dict[int, list[int]] | None = None) -> PrefillShape | None:
    """A recorded prefill step's shape where the record determines it: a single sequence (its prefix follows from
    the attention work, n * (n + 2p)), a padded group (every row the padded length), or a packed group whose members'
    prompt lengths (`groups`: group id -> prompt lengths, from the requests) add up to the step's tokens and work.
    A chunk step of several sequences keeps only totals: None."""
    rows, tokens, attn, width = int(row.rows), int(row.tokens), int(row.attn), int(row.padded_len)
    if getattr(row, "kind", "prefill") == "mixed":
        return fused_shape(row)
    if rows == 1:
        return PrefillShape.of([tokens], [(attn // tokens - tokens) // 2])
    if tokens == rows * width and attn == rows * width * width:
        return PrefillShape.padded(rows, width)
    prompts = (groups or {}).get(int(row.group_id))
    if prompts and len(prompts) == rows and sum(prompts) == tokens and sum(n * n for n in prompts) == attn:
        return PrefillShape.of(prompts)
    return None


def fused_shape(row) -> PrefillShape | None:
    """A fused step's shape where the record determines it: its decode rows (one position each; their prefixes sum
    to kv_tokens less one a row, the longest is kv_max less one, and a one-position sequence's price is otherwise
    linear in its prefix, so how the rest spread does not matter) and at most one chunk (its prefix follows from the
    step's attention work)."""
    d, rows = int(row.decode_rows), int(row.rows)
    if rows - d > 1:
        return None
    longest, rest = int(row.kv_max) - 1, int(row.kv_tokens) - d - (int(row.kv_max) - 1)
    decode = [longest] + [rest // (d - 1) + (i < rest % (d - 1)) for i in range(d - 1)] if d > 1 else [longest]
    computed, prefix = [1] * d, decode
    if rows > d:
        n = int(row.tokens) - d
        work = int(row.attn) - sum(1 + 2 * p for p in decode)
        computed, prefix = computed + [n], prefix + [(work // n - n) // 2]
    return PrefillShape.of(computed, prefix, d)


def _groups(requests) -> dict[int, list[int]]:
    if not len(requests):
        return {}
    return {int(g): sorted(map(int, d.prompt_tokens)) for g, d in requests.groupby("group_id")}


def held_s(steps, requests) -> np.ndarray:
    """How long each step held the engine (`steps` sorted by replica and start): until the next step's start where
    the engine went straight on to it (the step left rows running, or a request was waiting at its end), else
    until its end. The step loop's steps tile its busy time (servecap/core/step_loop.py), so on its records this is
    each step's end; records made before it tiled leave the host work between two steps (1-2% of a busy run) in
    a gap, which belongs to the engine's time all the same."""
    start, end = steps.start.to_numpy(float), steps.end.to_numpy(float)
    replica = steps.replica.to_numpy()
    out = end - start
    if len(steps) < 2:
        return out
    nxt = np.r_[start[1:], np.inf]
    same = np.r_[replica[1:] == replica[:-1], False]
    running = (steps.kind != "decode").to_numpy() | (steps.rows > steps.retired).to_numpy()
    waiting = np.zeros(len(steps), bool)
    for r in np.unique(replica):
        mine, reqs = replica == r, requests[requests.replica == r]
        arrived = np.searchsorted(np.sort(reqs.arrival.to_numpy(float)), end[mine], side="right")
        admitted = np.searchsorted(np.sort(reqs.admitted.to_numpy(float)), end[mine], side="right")
        waiting[mine] = arrived > admitted
    on = same & (running | waiting) & (nxt >= end)
    out[on] = nxt[on] - start[on]
    return out


def stretch_ends(steps) -> np.ndarray:
    """Per step (sorted by replica and start): the decode steps of the stretch it ends, where it is a decode step
    the next step of its replica does not go on from (the same rows, each a token longer, nothing retired or
    preempted in between: the step loop's stretch, servecap/core/step_loop.py); else 0."""
    n = len(steps)
    if not n:
        return np.zeros(0, int)
    dec = (steps.kind == "decode").to_numpy()
    rep, rows = steps.replica.to_numpy(), steps.rows.to_numpy()
    kv_max, kv_tokens = steps.kv_max.to_numpy(), steps.kv_tokens.to_numpy()
    pre = steps.preempted.to_numpy()
    goes_on = np.zeros(n, bool)
    goes_on[:-1] = (dec[:-1] & dec[1:] & (rep[1:] == rep[:-1]) & (steps.retired.to_numpy()[:-1] == 0)
                    & (rows[1:] == rows[:-1]) & (kv_max[1:] == kv_max[:-1] + 1)
                    & (kv_tokens[1:] == kv_tokens[:-1] + rows[:-1]) & (pre[1:] == 0))
    first = dec & ~np.r_[False, goes_on[:-1]]  # a decode step no step goes on into starts a stretch
    at = np.cumsum(dec) - np.maximum.accumulate(np.where(first, np.cumsum(dec) - 1, -1))  # its place in its stretch
    return np.where(dec & ~goes_on, at, 0)


def _retired_after(steps, requests) -> np.ndarray:
    """Per step (sorted by replica and start): the rows that retire right after it where it is a prefill or fused
    step ending its pass. Their retirement then follows the step, with no decode step of the pass to hold it (a
    decode step's row counts its own, `retired`); they are the requests that finished at its end."""
    out = np.zeros(len(steps), int)
    if not len(requests):
        return out
    finished = requests.groupby(["replica", "finished"]).size().to_dict()
    rep, step, kind, end = (steps[c].to_numpy() for c in ("replica", "step", "kind", "end"))
    for i in np.flatnonzero(kind != "decode"):
        if i + 1 < len(steps) and rep[i + 1] == rep[i] and step[i + 1] == step[i] and kind[i + 1] == "decode":
            continue
        out[i] = finished.get((rep[i], end[i]), 0)
    return out


def priced_steps(rec, cost: CostModel, telemetry=None):
    """The record's steps (RunRecord) with their context and price (COLUMNS), as a DataFrame; prefill steps whose
    shape the record does not determine are left out. `telemetry` (servecap/traces/telemetry.py) adds the clock."""
    import pandas as pd

    from servecap.traces.telemetry import join_steps

    meta = rec.meta
    backend, policy = meta["backend"], meta.get("prefill", "padded")
    steps = rec.steps.sort_values(["replica", "start"], kind="stable").reset_index(drop=True)
    if not len(steps):
        return pd.DataFrame(columns=COLUMNS)
    steps = join_steps(steps, telemetry)
    prev_end = steps.groupby("replica").end.shift()
    prev_kind = steps.kind.where((steps.kind != "decode") | (steps.retired == 0), RETIRED)
    prev_kind = prev_kind.groupby(steps.replica).shift()
    idle = (steps.start - prev_end).fillna(math.inf)
    groups = _groups(rec.requests)
    model = np.full(len(steps), np.nan)
    dec = (steps.kind == "decode").to_numpy()
    for rows, idx in steps[dec].groupby("rows").groups.items():
        d = steps.loc[idx]
        model[idx] = cost.decode(backend, int(rows), d.kv_tokens.to_numpy(), d.kv_max.to_numpy())
    for i in np.flatnonzero(~dec):
        shape = prefill_shape(steps.iloc[i], groups)
        if shape is not None:
            model[i] = cost.prefill(shape)
    retired = np.where(dec, steps.retired.to_numpy(), _retired_after(steps, rec.requests))
    kinds = np.where(dec, decode_kind(backend, policy), prefill_kind(policy))
    out = pd.DataFrame({"replica": steps.replica, "start": steps.start, "step_kind": steps.kind, "kind": kinds,
                        "rows": steps.rows.astype(int), "kv_max": steps.kv_max.astype(int),
                        "kv_tokens": steps.kv_tokens.astype(int),
                        "tokens": steps.tokens.astype(int),
                        "prev_kind": prev_kind.where(prev_kind.notna(), None),
                        "idle_s": idle, "real_s": held_s(steps, rec.requests), "model_s": model,
                        "retire_s": cost.retire_s * retired, "stretch_end": stretch_ends(steps),
                        "clock_mhz": steps.sm_clock_mhz})
    return out[np.isfinite(out.model_s)].reset_index(drop=True)


def contextual(steps, correction, typical: bool = False) -> np.ndarray:
    """The price of each priced step (priced_steps) in its serving context: its scaled part (scaled_price) plus its
    retirement and the end of the stretch it ends (host_price)."""
    return scaled_price(steps, correction, typical) + host_price(steps, correction)


def host_price(steps, correction) -> np.ndarray:
    """Each priced step's retirement and the end of the stretch it ends (under `correction`; None: none): host work,
    which no step factor scales and a GPU's speed does not move."""
    return steps.retire_s.to_numpy() + (stretch_end_prices(steps, correction) if correction is not None else 0.0)


def scaled_price(steps, correction, typical: bool = False) -> np.ndarray:
    """Each priced step's model_s x the factor of `correction` (a costs.context.Correction, e.g.
    CostModel.correction; None: model_s as it is): the part of its price that scales with the step.
    `typical`: a typical step's price, the class's median factor (what a median of real / price is graded
    against); else the summed one, whose sum over a run is the run's price."""
    if correction is None or not len(steps):
        return steps.model_s.to_numpy()
    columns = (steps[c].tolist() for c in ("kind", "prev_kind", "idle_s", "rows", "kv_max", "tokens", "kv_tokens"))
    f = [correction.factor(k, p, i, r, c if c == c else None, m, t, typical, v) for k, p, i, r, m, t, v, c in
         zip(*columns, steps.clock_mhz.astype(float).tolist())]
    return steps.model_s.to_numpy() * np.asarray(f)


def stretch_end_prices(steps, correction) -> np.ndarray:
    """Each priced step's stretch end under `correction` (a costs.context.Correction): 0 where it ends none."""
    return np.asarray([correction.stretch_end(k, n) if n else 0.0
                       for k, n in zip(steps.kind.tolist(), steps.stretch_end.tolist())], float)
