"""Prediction intervals: a band around every predicted metric (served rate, queue wait, TTFT and TPOT
percentiles, a closed run's wall time) that combines the things a real run can differ by.

1. Trace sampling: the point simulated on each of several trace seeds (a seeded workload's draws; a trace file is
   one sample, as in a sweep's --seeds). A validation point replays one fixed trace, so its band has one sample.
2. The cost level of a run: each simulated run's step costs multiplied by a draw F = exp(sigma * z), z at the
   (j + 0.5) / COST_DRAWS quantiles of the standard normal (quantile-spaced draws: reproducible, no random
   generator; the band's edges are read at the same plotting positions, numpy's "hazen" percentiles, so that for a
   metric monotone in F they fall at z = -/+ z_level). sigma is a step kind's own where the correction measured it
   (below), else sigma_cost, sqrt(held^2 + gpu^2 + run^2):
   - held: a corrected table's held-out residual at the level of a whole run (correction.residual_sigma["all"], the
     RMS over held-out runs of the log of the summed step time error), which holds each held-out run's own noise, so
     that `run` is then left out; else the RMS of the log error of the calibration's held-out shapes;
   - gpu: the GPU-to-GPU spread. Where the correction's held-out runs ran on MIN_GPUS or more GPUs
     (correction.held_out_gpus), `held` holds it already: one correction prices every GPU, so each held-out run's
     error carries its GPU's offset (their GPUs' mean errors spread as widely as the sessions' mean speeds: README,
     validation v21), and gpu is then left out; held out by GPU (`calibrate --from-runs --holdout gpu`), each run is
     priced as on a GPU the correction never saw, so two GPUs are enough. Else from the repeated real runs'
     sessions (the sd of their mean log speeds, below, or an earlier noise file's where the engine has run on fewer
     than three GPUs),
     else, where no noise file has sessions, from a refresh (the RMS of the log of a refreshed table's factors). A
     refresh does not take the term away: refreshed GPUs' mean serving speeds spread about their refreshed tables as
     widely as the sessions' about one table (README, validation v20), and a refresh's factors say how far it moved
     the table, not how far the refreshed table still is from what that GPU costs in serving;
   - run: the run-to-run spread of a run's speed measured from repeated real runs (below).
   A step kind's own sigma, sqrt(kind^2 + gpu^2) (gpu where `held` does not hold it), where the correction gives
   kind = residual_sigma[kind], the RMS over its held-out runs of the log error of that kind's summed steps: a GPU's
   offset is not one factor on every step (validation v28's H100 ran prefill 2.4-3.3% under its price, decode within
   0.5%), and near capacity TTFT follows prefill's. One z draws every kind (their errors taken to move together), so
   the edges stay at -/+ z_level; over five sessions' runs, bands made so came nearer their level than one factor
   for every step (README, validation v29). Drawn apart (Intervals(apart=True), `scripts/rebanded.py --draws
   apart`): decode's kinds at one z, the prompt steps' at another, the pairs spread as independent draws (_apart),
   for H100s whose two speeds hardly moved together (README, validation v39 on a twenty-fourth H100). Graded blind
   (validation v46, on a twenty-fifth H100 whose prompt steps ran slow and its decode not), such bands held under the
   target where one z's held, so plans keep one z (`validate plan --cost-draws apart` makes the other).
   Near capacity a percent of speed moves TTFT by tens of percent; drawing it as a cost factor lets the simulator
   say how much, point by point, instead of one spread for every point.
   A table rescaled to one GPU's own serving runs (`calibrate --from-runs RUNS --table T --rescale`) keeps this
   rule, though the rescale has taken that GPU's offset away: a few points' runs do not read the speed of the GPU's
   other points much better than the GPU-to-GPU spread. Priced instead by the spread of the runs read (one more
   run's prediction interval), such bands fell far short of their level, blind, where this rule's held it (README,
   validation v42).
3. What the run-to-run noise leaves beyond speed, measured from repeated real runs (servecap/costs/data/run_to_run.json,
   written by `python -m validate noise --table` with its sources): per metric and regime (closed, arrival), the
   sd over repeats of log(measured / simulated at the run's own speed) (a file without it: the sd of the log of the
   metric itself). Arrival points mix the file's two loads, below capacity and past it (`arrival-stable`,
   `arrival-unstable`: several-fold apart in queue waits and TTFT), by the share p of the point's samples the
   simulator judged stable: s^2 = p s_stable^2 + (1 - p) s_unstable^2 (a zero-mean mixture's variance); a file
   without them: the pooled `arrival` sd.

Combined: the Monte-Carlo samples over seeds x cost draws give the band's quantiles around their median m; each
side's log half-width is then widened in quadrature by z_level * sigma_noise: lo = m exp(-sqrt(log(m / q_lo)^2 +
(z s)^2)), and so for hi (the sources taken as independent). The point prediction is not changed.
"""
from __future__ import annotations

import json
import math
import multiprocessing
import os
import warnings
from pathlib import Path
from statistics import NormalDist

import numpy as np

from servecap.costs.context import ALL, PREFILL, current_kind, speed_kind
from servecap.costs.model import CostModel
from servecap.costs.table import CORRECTED_VERSION, CostTable
from servecap.traces.errors import InputError

from .workers import recording_warnings, tie_to_parent

MIN_GPUS = 3  # held-out runs on this many GPUs or more: their residual holds the GPU-to-GPU spread
METRICS = ("served_rate", "queue_wait_p50", "queue_wait_p95", "ttft_p50", "ttft_p95", "tpot_p50", "wall_time_s")
COST_DRAWS = 16
SEEDS = 5
NOISE = Path(__file__).resolve().parent.parent / "costs" / "data" / "run_to_run.json"


def _rms_log(values) -> float | None:
    logs = [math.log(v) for v in values if v and v > 0]
    return math.sqrt(sum(x * x for x in logs) / len(logs)) if logs else None


def cost_sigma(table: CostTable, noise: dict | None = None) -> dict:
    """sigma_cost and its terms, each with where it came from (module docstring); `noise` the run-to-run file."""
    c = table.correction or {}
    held = (c.get("residual_sigma") or {}).get("all")
    per_run = held is not None
    if per_run:
        held_from = "the correction's held-out runs (summed step time, RMS of the log error)"
    else:
        errors = [1 + p["error"] for p in (table.raw.get("accuracy") or {}).get("points", [])]
        held, held_from = _rms_log(errors), "the calibration's held-out shapes (RMS of the log error)"
    gpus = c.get("held_out_gpus") or {}
    gpu_in_held = per_run and gpus.get("n", 0) >= (2 if c.get("holdout") == "gpu" else MIN_GPUS)
    if gpu_in_held:
        gpu, gpu_from = None, f"held in the held-out runs' term (they ran on {gpus['n']} GPUs)"
    elif (noise or {}).get("sessions"):
        gpu, gpu_from = noise["sessions"]["sigma"], (f"the sd of {len(noise['sessions']['mean_log_speed'])} "
                                                     "sessions' mean run speed (run_to_run.json)")
    else:
        refresh = table.raw.get("refresh") or {}
        gpu = _rms_log((refresh.get("applied", refresh.get("factors")) or {}).values())
        gpu_from = ("the table's refresh factors" if gpu is not None else
                    "not measured (the table was not refreshed, the noise file has no sessions)")
    pooled = (noise or {}).get("pooled", {})
    speed = (pooled.get("arrival") or pooled.get("closed") or {}).get("speed")
    run = None if per_run or speed is None else speed["sigma"]
    terms = {"held_out": {"sigma": held, "from": held_from if held is not None else "none in the table"},
             "gpu_to_gpu": {"sigma": gpu, "in_held_out": gpu_in_held, "from": gpu_from},
             "run_to_run": {"sigma": run, "in_held_out": per_run,
                            "from": "held in the held-out runs' term" if per_run else
                            "repeated real runs' speed (run_to_run.json)" if run is not None else
                            "not measured (the noise file has no speeds)"}}
    beyond = 0.0 if gpu is None else gpu
    kinds = {current_kind(k): math.hypot(v, beyond) for k, v in (c.get("residual_sigma") or {}).items()
             if per_run and k != ALL and v is not None}
    return {"sigma": math.sqrt(sum(t["sigma"] ** 2 for t in terms.values() if t["sigma"] is not None)),
            "terms": terms, "kinds": kinds}


def load_noise(path: Path = NOISE) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise InputError("no measured run-to-run noise (python -m validate noise makes it)", path=path) from None
    if doc.get("schema") != "run-to-run-noise":
        raise InputError("is not a run-to-run noise file", path=path)
    return doc


def draw(cost: dict, z: float, z_prompt: float | None = None) -> dict[str, float]:
    """The cost draw at the standard normal's z: each step kind's factor exp(sigma_kind z), and `all`'s, exp(sigma_cost
    z), for the kinds without their own sigma (module docstring); `z_prompt`: the prompt steps' kinds (prefill, chunk
    and fused steps) drawn at it instead, apart from decode's."""
    zp = z if z_prompt is None else z_prompt
    return {ALL: math.exp(cost["sigma"] * z),
            **{k: math.exp(s * (zp if speed_kind(k) == PREFILL else z)) for k, s in cost.get("kinds", {}).items()}}


def _apart(n: int) -> list[int]:
    """The order pairing n quantile-spaced prompt draws with the decode draws so that the pairs spread over the plane
    like independent ones: j sorted by j times the golden ratio's fraction, mod 1 (a Kronecker lattice; at
    COST_DRAWS the two nearly uncorrelated, where the bit reversal of a Hammersley set would leave them at +0.38)."""
    u = [(j * (math.sqrt(5) - 1) / 2) % 1 for j in range(n)]
    return sorted(range(n), key=lambda j: u[j])


def scaled_table(table: CostTable, factor: float | dict[str, float]) -> dict:
    """The table's JSON object with every step cost times `factor` (its correction's scale: one factor, or a draw's
    factors by step kind)."""
    raw = {k: v for k, v in table.raw.items() if k != "table_id"}
    raw.update(version=CORRECTED_VERSION, correction={**(table.correction or {"factors": {}}), "scale": factor})
    return raw


def scaled(table: CostTable, factor: float | dict[str, float]) -> CostModel:
    """The table's model with every step cost times `factor`."""
    return CostModel(scaled_table(table, factor))


def noise_sigma(pooled: dict, metric: str, closed: bool, stable: float | None = None) -> float:
    """The run-to-run sd beyond speed the band widens `metric` by: closed runs', else the two loads' mixed by the
    share `stable` of the point's samples that kept up (module docstring), else (a file without them, or samples
    without a verdict: stable None) the pooled arrival sd."""
    def sd(regime: str) -> float | None:
        d = pooled.get(regime, {}).get(metric)
        return None if d is None else d.get("residual_sigma", d.get("sigma"))
    if closed:
        return sd("closed") or 0.0
    below, past = sd("arrival-stable"), sd("arrival-unstable")
    if stable is None or below is None or past is None:
        return sd("arrival") or 0.0
    return math.sqrt(stable * below ** 2 + (1 - stable) * past ** 2)


def z_level(level: float) -> float:
    """The standard normal's quantile at a LEVEL% two-sided band's upper edge."""
    return NormalDist().inv_cdf(0.5 + level / 200)


def edge_factors(table: CostTable, level: float, noise: dict | None = None) -> tuple[dict, dict, dict]:
    """The cost draws at a LEVEL% band's edges, z = -/+ z_level, and sigma_cost with its terms: where a metric is
    monotone in the cost level (a capacity, a replica count), its band edges are its values there."""
    cost = cost_sigma(table, noise if noise is not None else load_noise())
    z = z_level(level)
    return draw(cost, -z), draw(cost, z), cost


def describe_draw(factors: dict[str, float]) -> str:
    """A draw's factors, in a few words: `x0.981`, or their range where step kinds have their own."""
    own = [v for k, v in factors.items() if k != ALL]
    if not own:
        return f"every step x{factors[ALL]:.3f}"
    return f"steps x{min(own):.3f}-{max(own):.3f} by kind (x{factors[ALL]:.3f} the rest)"


def describe_sigma(cost: dict) -> str:
    """sigma_cost and its terms, in a line."""
    t = cost["terms"]
    run, gpu = ("in the held-out term" if t[k].get("in_held_out") else _pct(t[k]["sigma"])
                for k in ("run_to_run", "gpu_to_gpu"))
    kinds = cost.get("kinds") or {}
    own = f"; by step kind {min(kinds.values()):.1%}-{max(kinds.values()):.1%}" if kinds else ""
    return (f"cost sigma {cost['sigma']:.1%}: held-out {_pct(t['held_out']['sigma'])}, GPU-to-GPU {gpu}, "
            f"run-to-run speed {run}{own}")


class Intervals:
    """Bands at one level for points simulated on one table: the cost draws' models are made once."""

    def __init__(self, table: CostTable, level: float, noise: dict | None = None, apart: bool = False):
        self.table, self.level, self.apart = table, level, apart
        self.z = z_level(level)
        self.noise = noise if noise is not None else load_noise()
        self.cost = cost_sigma(table, self.noise)
        zs = [NormalDist().inv_cdf((j + 0.5) / COST_DRAWS) for j in range(COST_DRAWS)]
        pair = _apart(COST_DRAWS) if apart else range(COST_DRAWS)
        self.factors = [draw(self.cost, z, zs[i]) for z, i in zip(zs, pair)]
        self.models = [scaled(table, f) for f in self.factors]

    def band(self, traces: list, run, progress: bool = False, jobs: int = 1) -> dict:
        """Every metric's band for a point: `run(trace, cost_model)` simulates and scores one run (a summary dict);
        `traces` are its trace samples (seeds). `progress`: a bar on stderr over the runs; `jobs`: processes to run
        them in (forked, so that `run` need not be pickled; one where fork is not there)."""
        samples = _runs([(t, m) for t in traces for m in self.models], run, progress, jobs)
        closed = (traces[0].meta.get("rate") or traces[0].offered_rate) is None
        verdicts = [s.get("stable") for s in samples]
        stable = None if None in verdicts else float(np.mean(verdicts))
        out = {}
        for k in METRICS:
            v = np.array([s.get(k) if s.get(k) is not None else math.nan for s in samples], float)
            if not len(v) or not np.all(np.isfinite(v) & (v > 0)):
                continue
            m = float(np.median(v))
            q_lo, q_hi = np.percentile(v, [50 - self.level / 2, 50 + self.level / 2], method="hazen")
            s = noise_sigma(self.noise["pooled"], k, closed, stable)
            lo = m * math.exp(-math.hypot(math.log(m / q_lo), self.z * s))
            hi = m * math.exp(math.hypot(math.log(q_hi / m), self.z * s))
            out[k] = {"lo": lo, "hi": hi, "median": m}
        return out

    def describe(self) -> dict:
        """What a band was made of, for a plan or a printout."""
        return {"level": self.level, "cost_sigma": self.cost, "cost_factors": self.factors,
                **({"apart": "decode and prompt steps drawn apart"} if self.apart else {}),
                "noise": {"source": str(NOISE.name), "pooled": self.noise["pooled"],
                          "points": [g["point"] for g in self.noise["groups"]], "table": self.noise.get("table")},
                "method": "Monte-Carlo over trace seeds x quantile-spaced cost draws, a sigma per step kind where the "
                          "correction measured one (hazen percentiles), widened in "
                          "quadrature in log space by the measured run-to-run spread beyond speed, below and past "
                          "capacity mixed by the share of samples stable (servecap/sim/intervals.py)"}


_forked: tuple | None = None  # (pairs, run) of the band being run, which forked workers inherit


def _run_pair(i: int) -> tuple[dict, list[str]]:
    pairs, run = _forked
    return recording_warnings(run, *pairs[i])


def _runs(pairs: list[tuple], run, progress: bool, jobs: int) -> list[dict]:
    """run(trace, model) for every pair, in order: here, or in `jobs` forked processes, their warnings said here."""
    global _forked
    from tqdm import tqdm

    def bar():
        return tqdm(total=len(pairs), desc="interval", unit="run", disable=not progress, leave=False, delay=2)
    jobs = min(jobs, len(pairs)) if "fork" in multiprocessing.get_all_start_methods() else 1
    if jobs <= 1:
        out = []
        with bar() as b:
            for p in pairs:
                out.append(run(*p))
                b.update()
        return out
    _forked = (pairs, run)
    try:
        # forked before the bar can start tqdm's monitor thread: a thread running at a fork can leave a lock held
        with multiprocessing.get_context("fork").Pool(jobs, initializer=tie_to_parent, initargs=(os.getpid(),)) \
                as pool, bar() as b:
            out = []
            for summary, caught in pool.imap(_run_pair, range(len(pairs))):
                out.append(summary)
                for message in caught:
                    warnings.warn(message, stacklevel=2)
                b.update()
            return out
    finally:
        _forked = None


def seeded(trace_of, seed: int, n: int = SEEDS) -> list:
    """The trace samples of a seeded workload: `trace_of(seed)` for n seeds from `seed`."""
    return [trace_of(seed + i) for i in range(n)]


def simulated(cfg, rate: float | None):
    """run(trace, cost) for Intervals.band: one simulated run of the configuration (a fleet where it has more than
    one replica), scored as a prediction is."""
    from dataclasses import replace

    from servecap.traces.metrics import scored

    from .simulator import simulate
    cfg = replace(cfg, detail="steps")

    def run(trace, cost) -> dict:
        if cfg.serving.replicas > 1:
            from .fleet import simulate_fleet
            rec = simulate_fleet(trace, cost, cfg).record
        else:
            rec = simulate(trace, cost, cfg).record
        return scored(rec, rate)
    return run


# (name, unit, scale from the metric's own unit, format): latencies in ms, as the latency table and vLLM print them
NAMES = {"served_rate": ("served", "req/s", 1, ".2f"), "queue_wait_p50": ("queue wait p50", "ms", 1e3, ".1f"),
         "queue_wait_p95": ("queue wait p95", "ms", 1e3, ".1f"), "ttft_p50": ("TTFT p50", "ms", 1e3, ".1f"),
         "ttft_p95": ("TTFT p95", "ms", 1e3, ".1f"), "tpot_p50": ("TPOT p50", "ms", 1e3, ".2f"),
         "wall_time_s": ("wall", "s", 1, ".3f")}


SPEEDS = (0.98, 0.99, 1.0, 1.01, 1.02)  # every step's cost times each, for speed_slopes


def speed_slopes(run, trace, table: CostTable) -> dict[str, float]:
    """Each metric's relative change with every step 1% slower: the least-squares slope of its log over the point
    simulated at each of SPEEDS of the table's costs (one run near capacity moves in steps at a single percent). Near
    capacity a percent of speed moves TTFT and queue waits by many percent: how far a GPU instance's own speed, off
    its kind's, moves the point. The band's cost draws hold that spread; the slope says how much of it is speed."""
    ys = [run(trace, scaled(table, f)) for f in SPEEDS]
    out = {}
    for k in NAMES:
        v = np.array([y.get(k, math.nan) for y in ys], dtype=float)
        if np.all(np.isfinite(v) & (v > 0)):
            out[k] = math.expm1(np.polyfit(np.log(SPEEDS), np.log(v), 1)[0] * math.log(1.01))
    return out


def speed_line(slopes: dict[str, float]) -> str:
    """`sim run --interval`'s line of speed_slopes."""
    return "speed    every step 1% slower: " + ", ".join(f"{NAMES[k][0]} {v:+.1%}" for k, v in slopes.items())


def lines(bands: dict, iv: Intervals, samples: int) -> list[str]:
    """A band per metric, as `sim run` prints them."""
    out = [f"interval {iv.level:g}%: {samples} trace sample(s) x {COST_DRAWS} cost draws "
           f"({describe_sigma(iv.cost)}), widened by the measured run-to-run noise beyond speed"]
    for k, b in bands.items():
        name, unit, scale, spec = NAMES[k]
        out.append(f"  {name:15s} {format(b['lo'] * scale, spec)} .. {format(b['hi'] * scale, spec)} {unit}")
    return out


def _pct(v: float | None) -> str:
    return "not measured" if v is None else f"{v:.1%}"


INTERVALS_FILE = "sweep.intervals.csv"
