"""The measurement plan: which closed runs a calibration makes, in what order, and what they cost to make.

Every timing comes from the engine's own step log (servecap/calibrate/measure.py drives the engine), so admission,
scheduling, the KV copy, graph replay and record writes are inside the numbers exactly as they are inside a real
run. A planned run is measured whole and stored as one line of the points file (servecap/calibrate/store.py), which is
what makes a calibration resumable.

Order: the stationarity check first (shapes the engine has never run, each timed on its first run and again:
nothing may run before them but the engine's own start-up), then the padded prefill grid, the other policies'
prefill steps, decode per backend, and the held-out shapes of the accuracy check.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from servecap.core.config import ServingConfig
from servecap.costs.shapes import RENAMED_BACKENDS

WIDTHS = (1, 2, 4, 8, 16, 32)
LENGTHS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# Decode row counts measured: every count where the kernel's split choice changes, sparser above.
DECODE_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32)

# Speeds for the up-front time estimate: the engine's start (weights, kernels, decode and prefill graphs), a
# padded prefill token, a decode step, and a closed run's own overhead (records written and read back).
H200_SPEEDS = {"engine_start_s": 40.0, "prefill_token_s": 5.3e-6, "decode_step_s": 2.4e-3, "run_s": 0.04}


@dataclass(frozen=True)
class Plan:
    """The sizes of a calibration. FULL is the real one; QUICK is a smoke test of the whole path."""

    name: str
    max_prompt: int
    max_budget: int
    widths: tuple[int, ...]  # prefill group widths, clipped to max batch (max batch itself is added)
    lengths: tuple[int, ...]  # prefill padded lengths
    prefill_reps: int  # recorded repetitions of a prefill shape, after one warm-up
    decode_rows: tuple[int, ...]  # row counts of the decode runs, clipped to max batch (max batch is added)
    decode_lengths: tuple[int, ...]  # uniform prompt lengths of the decode runs; max_prompt is always one
    mixed_runs: int  # decode runs per row count with random prompt lengths (the longest row apart from the rest)
    decode_budget: int  # tokens per request of a decode run: budget - 1 decode steps
    window: int  # decode steps per measured point; a long run gives several points
    max_rows: int | None  # cap on max batch (QUICK keeps CPU runs short)
    policy_runs: int  # prefill runs per other policy (packed groups; chunked prompts)
    chunk: int  # the chunk size the chunked runs measure
    check_prefill: int  # held-out padded shapes in the accuracy check (and this many for each other policy / 2)
    check_decode: int  # held-out decode runs per backend
    check_reps: int
    stationary_prefill: int  # never-run prefill shapes in the stationarity check
    stationary_decode: int
    seed: int = 0
    # The engine's per-step token cap (max_num_batched_tokens; None: none). Every prefill shape fits one step of
    # it; a row count of long_rows also runs uniform decode at the lengths one step cannot hold for it, its
    # prompts prefilled in several groups (its points are the steps that hold every row).
    max_step_tokens: int | None = None
    long_rows: tuple[int, ...] = ()
    fused_budget: int | None = None  # the budget the fused runs' prompts are scaled to outlast (None: max_budget)

    def longest(self, rows: int) -> int:
        """The longest prompt a group of `rows` prompts may have, for their prefill to be one step."""
        return self.max_prompt if self.max_step_tokens is None else \
            max(1, min(self.max_prompt, self.max_step_tokens // rows))


FULL = Plan("full", max_prompt=4096, max_budget=256, widths=WIDTHS, lengths=LENGTHS, prefill_reps=5,
            decode_rows=DECODE_ROWS, decode_lengths=(16, 256, 1024, 2048), mixed_runs=3, decode_budget=64, window=32,
            max_rows=None, policy_runs=24, chunk=512, check_prefill=16, check_decode=8, check_reps=3,
            stationary_prefill=24, stationary_decode=6)
# Full length: prompts and decode contexts to the model's 32768 positions (less a budget), at up to 4 rows, where
# long requests run (a prefill step of 32 x 32k tokens is not one any engine here plans)
LONG = Plan("long", max_prompt=32256, max_budget=512, widths=(1, 2, 4), lengths=LENGTHS + (8192, 16384, 32256),
            prefill_reps=3, decode_rows=(1, 2, 3, 4), decode_lengths=(16, 1024, 4096, 8192, 16384, 32256), mixed_runs=3,
            decode_budget=64, window=32, max_rows=4, policy_runs=8, chunk=512, check_prefill=12, check_decode=6,
            check_reps=2, stationary_prefill=12, stationary_decode=4)
# Both in one table: FULL's grid at 32 rows and LONG's lengths, each at the rows one step of 32 x 4096 tokens holds
# (the engine serves 32k prompts beside 32 rows under that cap), and uniform decode to the full length at 8-32 rows.
FULL_LENGTH = Plan("full-length", max_prompt=32256, max_budget=512, widths=WIDTHS,
                   lengths=LENGTHS + (8192, 16384, 32256), prefill_reps=5, decode_rows=DECODE_ROWS,
                   decode_lengths=(16, 256, 1024, 2048, 4096, 8192, 16384, 32256), mixed_runs=3, decode_budget=64,
                   window=32, max_rows=None, policy_runs=24, chunk=512, check_prefill=20, check_decode=10,
                   check_reps=3, stationary_prefill=24, stationary_decode=6, max_step_tokens=32 * 4096,
                   long_rows=(8, 16, 32), fused_budget=FULL.max_budget)
QUICK = Plan("quick", max_prompt=32, max_budget=5, widths=(1, 2), lengths=(16, 32), prefill_reps=2,
             decode_rows=(1, 2), decode_lengths=(16,), mixed_runs=1, decode_budget=5, window=32, max_rows=2,
             policy_runs=1, chunk=16, check_prefill=2, check_decode=1, check_reps=2, stationary_prefill=2,
             stationary_decode=1)


@dataclass(frozen=True)
class Run:
    """One planned measurement: a closed run (every request at t=0), made `warmup` + `reps` times.

    kind: "prefill" (budget 1: the run is its prefill steps), "decode" (budget-1 decode steps of fixed rows),
    "check-prefill" / "check-decode" (held out from the fit, for the accuracy check), or "stationary-prefill" /
    "stationary-decode" (a shape the engine has never run: its first run against its repeats).
    serving: the decode backend and prefill policy the run uses (its rows are its prompts, all admitted at once).
    """

    kind: str
    prompts: tuple[int, ...]
    budget: int
    serving: ServingConfig = ServingConfig()
    reps: int = 1
    warmup: int = 0
    label: str = ""

    @property
    def backend(self) -> str:
        return self.serving.backend

    @property
    def policy(self) -> str:
        return str(self.serving.prefill)

    @property
    def key(self) -> str:
        """The run's identity in the points file: every field that changes what is measured (not the label)."""
        # The backend under the name it had when the points files began (`padded` for dense), so they still resume.
        old = {new: name for name, new in RENAMED_BACKENDS.items()}
        d = {"kind": self.kind, "prompts": list(self.prompts), "budget": self.budget,
             "backend": old.get(self.backend, self.backend),
             "reps": self.reps, "warmup": self.warmup}
        if self.policy != "padded":  # the field came later: padded runs keep the keys they always had
            d["policy"] = self.policy
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

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
        per_run = self.width * self.padded_len if self.policy == "padded" else sum(self.prompts)
        return self.count * per_run

    @property
    def decode_steps(self) -> int:
        return self.count * (self.budget - 1)


def _on(plan: Plan, backend: str, policy: str = "padded", rows: int | None = None) -> ServingConfig:
    """The serving configuration of a run on `rows` rows at most (a fused policy's budget must hold them all)."""
    return ServingConfig(backend=backend, prefill=policy, max_num_batched_tokens=plan.max_step_tokens,
                         **({"max_batch": rows} if rows else {}))


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


def make_plan(plan: Plan, max_batch: int, backends: Sequence[str], policies: Sequence[str] = ("padded",)) -> list[Run]:
    """Every run of a calibration in order (see the module docstring). `policies` are the prefill policies the
    engine can run; padded is always measured, the others when listed."""
    rows_max = max_rows(plan, max_batch)
    widths, lengths = grid(plan, max_batch)
    others = [p for p in policies if p != "padded"]
    runs = stationarity_runs(plan, max_batch, backends, others)
    # Prefill does not depend on the decode backend; a run still names one the engine compiled.
    runs += [Run("prefill", (n,) * w, 1, _on(plan, backends[0]), reps=plan.prefill_reps, warmup=1,
                 label=f"prefill {w} x {n}") for w in widths for n in lengths if n <= plan.longest(w)]
    runs += policy_runs(plan, max_batch, backends[0], others, "prefill", plan.policy_runs, seed=2)
    uniform = _clip(plan.decode_lengths, plan.max_prompt)
    for b in backends:
        for r in _clip(plan.decode_rows, rows_max):
            for k in uniform:
                if k > plan.longest(r) and r not in plan.long_rows:
                    continue
                # The longest prompts run the whole budget, so the points reach the largest K/V a request holds.
                budget = plan.max_budget if k == plan.max_prompt else plan.decode_budget
                runs.append(Run("decode", (k,) * r, budget, _on(plan, b), label=f"decode {b} {_rows(r)} x {k}"))
            for m in range(plan.mixed_runs if r > 1 else 0):
                draw = np.random.default_rng([plan.seed, r, m]).integers(lengths[0], plan.longest(r) + 1, r)
                runs.append(Run("decode", tuple(int(k) for k in draw), plan.decode_budget, _on(plan, b),
                                label=f"decode {b} {_rows(r)} mixed {m + 1}"))
    runs += check_runs(plan, max_batch, backends, others)
    return list({r.key: r for r in runs}.values())  # a seeded draw may repeat a run: it is measured once


def policy_runs(plan: Plan, max_batch: int, backend: str, policies: Sequence[str], kind: str, count: int,
                seed: int) -> list[Run]:
    """Prefill runs of the other policies, seeded: packed groups of random width with random prompt lengths;
    chunked prompts of random lengths, alone (its chunks attend to longer and longer prefixes) or several short
    ones together (a chunk spans them); fused (mixed) groups of random width and lengths whose budget outlasts
    their prefill, so that the prompts prefilled first decode beside the later ones' chunks: a fused step's decode
    rows measured in a closed run, at the prefixes their prompts give them."""
    rng = np.random.default_rng([plan.seed, seed])
    rows_max = max_rows(plan, max_batch)
    lo, hi = np.log(16), np.log(plan.max_prompt)
    runs = []
    for policy in policies:
        for i in range(count):
            budget = 1
            if policy == "packed":  # a group the step cap holds: its prompts scaled down to fit
                w = int(rng.integers(1, rows_max + 1))
                prompts = tuple(int(round(np.exp(x))) for x in rng.uniform(lo, hi, w))
                if plan.max_step_tokens is not None and sum(prompts) > plan.max_step_tokens:
                    prompts = tuple(max(1, p * plan.max_step_tokens // sum(prompts)) for p in prompts)
            elif policy.startswith("mixed"):
                w = int(rng.integers(2, max(2, rows_max) + 1))  # prompts to what a full batch's step holds
                prompts, budget = fused_group(rng.uniform(lo, np.log(plan.longest(rows_max)), w), plan.chunk,
                                              plan.fused_budget or plan.max_budget)
            else:
                w = 1 if i % 2 == 0 else int(rng.integers(2, max(3, rows_max // 4) + 1))
                top = hi if w == 1 else np.log(max(17, plan.chunk))
                prompts = tuple(int(round(np.exp(x))) for x in rng.uniform(lo, top, w))
            reps = plan.prefill_reps if kind == "prefill" else plan.check_reps
            runs.append(Run(kind, prompts, budget, _on(plan, backend, policy, rows_max), reps=reps, warmup=1,
                            label=f"{kind} {policy} {_rows(w)} ({sum(prompts)} tokens)"))
    return runs


def fused_group(log_lengths: np.ndarray, chunk: int, max_budget: int) -> tuple[tuple[int, ...], int]:
    """A fused run's prompts (from their log lengths) and a budget that outlasts its prefill: each step after the
    first computes at least chunk - rows prompt positions, so the last prompt has its first token within
    ceil(total / (chunk - rows)) + 1 steps. Prompts are scaled down to fit that into max_budget - 1 steps."""
    w = len(log_lengths)
    prompts = [max(1, int(round(np.exp(x)))) for x in log_lengths]
    room = (max_budget - 3) * (chunk - w)
    if sum(prompts) > room:
        prompts = [max(1, p * room // sum(prompts)) for p in prompts]
    return tuple(prompts), min(max_budget, -(-sum(prompts) // (chunk - w)) + 3)


def check_runs(plan: Plan, max_batch: int, backends: Sequence[str], policies: Sequence[str] = ()) -> list[Run]:
    """Held-out shapes, seeded: random widths and padded lengths off the prefill grid (the group's other prompts
    are shorter, as in real admission groups), the other policies' steps, and random row counts with random
    prompt lengths for decode."""
    rng = np.random.default_rng([plan.seed, 1 << 20])
    rows_max = max_rows(plan, max_batch)
    widths, lengths = grid(plan, max_batch)
    lo, hi = np.log(lengths[0]), np.log(plan.max_prompt)
    runs = []
    while len(runs) < plan.check_prefill:
        w, n = int(rng.integers(1, rows_max + 1)), int(round(np.exp(rng.uniform(lo, hi))))
        if (w in widths and n in lengths) or n > plan.longest(w):
            continue
        prompts = (n, *(int(p) for p in rng.integers(min(lengths[0], n), n + 1, w - 1)))
        runs.append(Run("check-prefill", prompts, 1, _on(plan, backends[0]), reps=plan.check_reps, warmup=1,
                        label=f"check prefill {w} x {n}"))
    runs += policy_runs(plan, max_batch, backends[0], policies, "check-prefill", max(1, plan.check_prefill // 2),
                        seed=3)
    for b in backends:
        for _ in range(plan.check_decode):
            r = int(rng.integers(1, rows_max + 1))
            prompts = tuple(int(p) for p in rng.integers(lengths[0], plan.longest(r) + 1, r))
            runs.append(Run("check-decode", prompts, plan.decode_budget, _on(plan, b),
                            label=f"check decode {b} {_rows(r)}"))
    return runs


def stationarity_runs(plan: Plan, max_batch: int, backends: Sequence[str], policies: Sequence[str] = ()) -> list[Run]:
    """Shapes never run before, each run once and then again: random group widths 1..max batch and padded lengths
    17..max prompt off the grid (and the other policies' steps), and decode at random row counts and lengths.
    Seeded apart from every other run of the plan, so no shape here is one the plan measures elsewhere."""
    rng = np.random.default_rng([plan.seed, 1 << 21])
    rows_max = max_rows(plan, max_batch)
    widths, lengths = grid(plan, max_batch)
    runs, seen = [], set()
    while len(runs) < plan.stationary_prefill:
        w, n = int(rng.integers(1, rows_max + 1)), int(rng.integers(min(17, plan.max_prompt), plan.max_prompt + 1))
        if n in lengths or (w, n) in seen or n > plan.longest(w):
            continue
        seen.add((w, n))
        prompts = (n, *(int(p) for p in rng.integers(1, n + 1, w - 1)))
        runs.append(Run("stationary-prefill", prompts, 1, _on(plan, backends[0]), reps=3,
                        label=f"stationarity prefill {w} x {n}"))
    runs += [Run("stationary-prefill", r.prompts, r.budget, r.serving, reps=3,
                 label=r.label.replace("stationary-prefill", "stationarity"))
             for r in policy_runs(plan, max_batch, backends[0], policies, "stationary-prefill", min(2, plan.policy_runs),
                                  seed=4)]
    for _ in range(plan.stationary_decode):
        r = int(rng.integers(1, rows_max + 1))
        prompts = tuple(int(p) for p in rng.integers(17, plan.longest(r) + 1, r))
        runs.append(Run("stationary-decode", prompts, plan.decode_budget, _on(plan, backends[0]), reps=2,
                        label=f"stationarity decode {_rows(r)}"))
    return runs


def describe(runs: list[Run], speeds: dict | None = None) -> str:
    """The plan's size, and with `speeds` its estimated time (printed before any work)."""
    def part(*kinds: str) -> list[Run]:
        return [r for r in runs if r.kind in kinds]

    pre, dec = part("prefill"), part("decode")
    chk, sta = part("check-prefill", "check-decode"), part("stationary-prefill", "stationary-decode")
    lines = [f"plan: {len(sta)} stationarity runs; {len(pre)} prefill shapes "
             f"({sum(r.prefill_tokens for r in pre) / 1e6:.2f} M prefill tokens with repeats); "
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
