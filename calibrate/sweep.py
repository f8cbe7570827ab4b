"""The measurement plan and its driver: which closed runs a calibration makes, and making them on the engine.

Every timing comes from the engine's own step log, so admission, scheduling, the KV copy, graph replay and
record writes are inside the numbers exactly as they are inside a real run. A planned run is measured whole
and stored as one line of the points file (calibrate/store.py), which is what makes a calibration resumable.
The engine (torch) is imported only by the functions that drive it.
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np


WIDTHS = (1, 2, 4, 8, 16, 32)
LENGTHS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)

# H200 speeds for the up-front estimate, as measured there (results/bench, results/calibration): the engine's start
# (weights, compilation, 64 graph captures) about 25 s, a 32 x 4096 prefill 0.70 s, a decode step 2-3 ms, and
# a closed run's own overhead (records written and read back) about 40 ms.
H200_SPEEDS = {"engine_start_s": 25.0, "prefill_token_s": 0.70 / (32 * 4096), "decode_step_s": 2.4e-3, "run_s": 0.04}


@dataclass(frozen=True)
class Plan:
    """The sizes of a calibration. FULL is the real one; QUICK is a smoke test of the whole path."""

    name: str
    max_prompt: int
    max_budget: int
    widths: tuple[int, ...]  # prefill group widths, clipped to max batch (max batch itself is added)
    lengths: tuple[int, ...]  # prefill padded lengths
    prefill_reps: int  # recorded repetitions of a prefill shape, after one warm-up
    decode_lengths: tuple[int, ...]  # uniform prompt lengths of the decode runs; max_prompt is always one
    mixed_runs: int  # decode runs per row count with random prompt lengths (the longest row apart from the rest)
    decode_budget: int  # tokens per request of a decode run: budget - 1 decode steps
    window: int  # decode steps per measured point; a long run gives several points
    max_rows: int | None  # cap on max batch (QUICK keeps CPU runs short)
    check_prefill: int  # held-out shapes in the accuracy check
    check_decode: int  # held-out decode runs per backend
    check_reps: int
    seed: int = 0


FULL = Plan("full", max_prompt=4096, max_budget=256, widths=WIDTHS, lengths=LENGTHS, prefill_reps=5,
            decode_lengths=(16, 256, 1024, 2048), mixed_runs=3, decode_budget=64, window=32,
            max_rows=None, check_prefill=16, check_decode=8, check_reps=3)
QUICK = Plan("quick", max_prompt=32, max_budget=5, widths=(1, 2), lengths=(16, 32), prefill_reps=2,
             decode_lengths=(16,), mixed_runs=1, decode_budget=5, window=32, max_rows=2,
             check_prefill=2, check_decode=1, check_reps=2)


@dataclass(frozen=True)
class Run:
    """One planned measurement: a closed run (every request at t=0), made `warmup` + `reps` times.

    kind: "prefill" (budget 1, so the run is one prefill step), "decode" (budget-1 decode steps of fixed rows),
    or "check-prefill" / "check-decode" (held out from the fit, for the accuracy check).
    """

    kind: str
    prompts: tuple[int, ...]
    budget: int
    backend: str = "paged"
    reps: int = 1
    warmup: int = 0
    label: str = ""

    @property
    def key(self) -> str:
        """The run's identity in the points file: every field that changes what is measured (not the label)."""
        return json.dumps({k: v for k, v in asdict(self).items() if k != "label"}, sort_keys=True,
                          separators=(",", ":"))

    @property
    def width(self) -> int:
        return len(self.prompts)

    @property
    def padded_len(self) -> int:
        return max(self.prompts)

    @property
    def count(self) -> int:
        return self.warmup + self.reps

    @property
    def prefill_tokens(self) -> int:
        return self.count * self.width * self.padded_len

    @property
    def decode_steps(self) -> int:
        return self.count * (self.budget - 1)


def _rows(r: int) -> str:
    return f"{r} row" if r == 1 else f"{r} rows"


def max_rows(plan: Plan, max_batch: int) -> int:
    return min(max_batch, plan.max_rows or max_batch)


def _clip(values: Iterable[int], top: int) -> tuple[int, ...]:
    """The values below `top`, and `top` itself, so the grid's edge is measured rather than extrapolated."""
    return tuple(sorted({v for v in values if v < top} | {top}))


def grid(plan: Plan, max_batch: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The prefill grid's widths and padded lengths."""
    return _clip(plan.widths, max_rows(plan, max_batch)), _clip(plan.lengths, plan.max_prompt)


def make_plan(plan: Plan, max_batch: int, backends: Sequence[str]) -> list[Run]:
    """Every run of a calibration in order: the prefill grid, decode per backend, then the held-out check."""
    rows_max = max_rows(plan, max_batch)
    widths, lengths = grid(plan, max_batch)
    # Prefill does not depend on the decode backend; a run still names one the engine compiled.
    runs = [Run("prefill", (n,) * w, 1, backends[0], reps=plan.prefill_reps, warmup=1, label=f"prefill {w} x {n}")
            for w in widths for n in lengths]
    uniform = _clip(plan.decode_lengths, plan.max_prompt)
    for b in backends:
        for r in range(1, rows_max + 1):
            for k in uniform:
                # The longest prompts run the whole budget, so the points reach the largest K/V a request holds.
                budget = plan.max_budget if k == plan.max_prompt else plan.decode_budget
                runs.append(Run("decode", (k,) * r, budget, b, label=f"decode {b} {_rows(r)} x {k}"))
            for m in range(plan.mixed_runs if r > 1 else 0):
                draw = np.random.default_rng([plan.seed, r, m]).integers(lengths[0], plan.max_prompt + 1, r)
                runs.append(Run("decode", tuple(int(k) for k in draw), plan.decode_budget, b,
                                label=f"decode {b} {_rows(r)} mixed {m + 1}"))
    return runs + check_runs(plan, max_batch, backends)


def check_runs(plan: Plan, max_batch: int, backends: Sequence[str]) -> list[Run]:
    """Held-out shapes, seeded: random widths and padded lengths off the prefill grid (the group's other prompts
    are shorter, as in real admission groups), and random row counts with random prompt lengths for decode."""
    rng = np.random.default_rng([plan.seed, 1 << 20])
    rows_max = max_rows(plan, max_batch)
    widths, lengths = grid(plan, max_batch)
    lo, hi = np.log(lengths[0]), np.log(plan.max_prompt)
    runs = []
    while len(runs) < plan.check_prefill:
        w, n = int(rng.integers(1, rows_max + 1)), int(round(np.exp(rng.uniform(lo, hi))))
        if w in widths and n in lengths:
            continue
        prompts = (n, *(int(p) for p in rng.integers(min(lengths[0], n), n + 1, w - 1)))
        runs.append(Run("check-prefill", prompts, 1, backends[0], reps=plan.check_reps, warmup=1,
                        label=f"check prefill {w} x {n}"))
    for b in backends:
        for _ in range(plan.check_decode):
            r = int(rng.integers(1, rows_max + 1))
            prompts = tuple(int(p) for p in rng.integers(lengths[0], plan.max_prompt + 1, r))
            runs.append(Run("check-decode", prompts, plan.decode_budget, b, label=f"check decode {b} {_rows(r)}"))
    return runs


def describe(runs: list[Run], speeds: dict | None = None) -> str:
    """The plan's size, and with `speeds` its estimated time (printed before any work)."""
    def part(kinds: tuple[str, ...]) -> list[Run]:
        return [r for r in runs if r.kind in kinds]

    pre, dec, chk = part(("prefill",)), part(("decode",)), part(("check-prefill", "check-decode"))
    lines = [f"plan: {len(pre)} prefill shapes x {pre[0].count if pre else 0} runs "
             f"({sum(r.prefill_tokens for r in pre) / 1e6:.2f} M prefill tokens); "
             f"{len(dec)} decode runs ({sum(r.decode_steps for r in dec):,} decode steps, "
             f"{sum(r.prefill_tokens for r in dec) / 1e6:.2f} M prefill tokens); "
             f"{len(chk)} held-out runs for the accuracy check"]
    if speeds:
        total = estimate_s(runs, speeds)
        tokens, steps = sum(r.prefill_tokens for r in runs), sum(r.decode_steps for r in runs)
        lines.append(f"      estimated {total / 60:.1f} min at H200 speeds ({speeds['engine_start_s']:.0f} s "
                     f"engine start, {tokens / 1e6:.1f} M prefill tokens at "
                     f"{speeds['prefill_token_s'] * 32 * 4096:.2f} s per 32 x 4096, "
                     f"{steps:,} decode steps at {speeds['decode_step_s'] * 1e3:.1f} ms)")
    return "\n".join(lines)


def estimate_s(runs: list[Run], speeds: dict) -> float:
    return speeds["engine_start_s"] + sum(r.prefill_tokens * speeds["prefill_token_s"] + r.decode_steps *
                                          speeds["decode_step_s"] + r.count * speeds["run_s"] for r in runs)


def run_plan(runs: list[Run], done: Callable[[str], bool], measure: Callable[[Run], dict],
             record: Callable[[str, dict], None], on_run: Callable[[Run], None] = lambda r: None) -> int:
    """Measure every run not already done, recording each as soon as it is measured; returns how many it made."""
    made = 0
    for run in runs:
        if not done(run.key):
            record(run.key, measure(run))
            made += 1
        on_run(run)
    return made


# ---- the engine side (imports torch) --------------------------------------------------------------------

def identity(cfg) -> dict:
    """What a measurement depends on, known before the engine starts: a resume must match it exactly.

    Checks the device first (no GPU, or not the --expect-gpu one), so a wrong machine is refused before any work.
    """
    from engine.engine import check_device, device_info
    from traces.model_spec import config_hash
    from traces.provenance import versions

    device = device_info(check_device(cfg))
    return {"device": device["name"], "model": cfg.spec["name"], "config_hash": config_hash(cfg.spec),
            "dtype": cfg.dtype, "weights": f"checkpoint:{Path(cfg.checkpoint).resolve()}" if cfg.checkpoint
            else f"random(seed={cfg.seed})", "block_size": cfg.block_size, "max_batch": cfg.max_batch,
            "max_prompt": cfg.max_prompt, "max_budget": cfg.max_budget, **versions(("torch", "triton", "transformers"))}


def measure(engine, run: Run) -> dict:
    """Make `run` on the engine and keep what the points need from its step log.

    Each repetition writes a real run record to a scratch directory: retirement's cost is writing the finished
    requests' records, and a calibration that kept them in memory would measure a cheaper retirement than a
    real run pays.
    """
    from traces.workload import length_trace

    trace = length_trace([(0.0, p, run.budget) for p in run.prompts], {"kind": "calibration", "label": run.label})
    prefill_s, steps = [], None
    for i in range(run.count):
        with tempfile.TemporaryDirectory(prefix="calibrate-") as tmp:
            rec = engine.run(trace, Path(tmp) / "run", backend=run.backend, progress=False)
        pre, dec = rec.steps[rec.steps.kind == "prefill"], rec.steps[rec.steps.kind == "decode"]
        if len(pre) != 1 or pre.rows.iloc[0] != run.width or (dec.rows != run.width).any():
            raise RuntimeError(f"{run.label}: the engine did not admit the run as one group of {run.width} "
                               f"(prefill groups {pre.rows.tolist()}); is its KV pool too small?")
        if i >= run.warmup:
            prefill_s.append(float(pre.end.iloc[0] - pre.start.iloc[0]))
            steps = dec
    if run.kind in ("prefill", "check-prefill"):
        return {"prefill_s": prefill_s}
    return {"kv_tokens": steps.kv_tokens.astype(int).tolist(), "kv_max": steps.kv_max.astype(int).tolist(),
            "start": steps.start.tolist(), "end": steps.end.tolist()}
