"""Making a planned run on the engine (the only part of calibration that imports torch, and only when called).

A run is replayed as a closed trace through the engine's own `run`, and its step log is what is kept: per
repetition, every prefill step's shape and duration; for decode runs, the last repetition's decode steps.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from .gpu_state import GpuState
from .plan import Run

# Idle time before each repetition of a stationarity run. A step runs up to ~30% slower for tens of steps after a
# compute-bound burst while the SM clock recovers; without a common idle start, a small shape measured right after
# a large one is slower on its first run than on its repeats for a reason that has nothing to do with its shape.
STATIONARY_SETTLE_S = 0.5


def identity(cfg) -> dict:
    """What a measurement depends on, known before the engine starts: a resume must match it exactly, down to
    the physical GPU.

    Checks the device first (no GPU, or not the --expect-gpu one), so a wrong machine is refused before any work.
    """
    from servecap.engine.engine import check_device, device_info
    from servecap.traces.model_spec import config_hash
    from servecap.traces.provenance import versions

    device = device_info(check_device(cfg))
    serving = cfg.serving
    return {"device": device["name"], "gpu_uuid": device.get("uuid"), "model": serving.spec["name"],
            "config_hash": config_hash(serving.spec), "dtype": serving.dtype,
            "weights": f"checkpoint:{Path(cfg.checkpoint).resolve()}" if cfg.checkpoint else f"random(seed={cfg.seed})",
            "block_size": serving.block_size, "max_batch": serving.max_batch, "max_prompt": cfg.max_prompt,
            "max_budget": cfg.max_budget, **versions(("torch", "triton", "transformers"))}


def telemetry(path: Path | None, ident: dict):
    """The GPU telemetry recording of a whole calibration into `path` (servecap/engine/telemetry.py), samples stamped in
    unix time; appended to on a resume."""
    from servecap.engine.telemetry import record_to
    return record_to(path, {"name": ident["device"], "uuid": ident["gpu_uuid"]})


def telemetry_path(table: Path) -> Path:
    return table.with_name(table.name + ".telemetry.csv")


def measure(engine, run: Run, settle_s: float = STATIONARY_SETTLE_S) -> dict:
    """Make `run` on the engine and keep what the points need from its step log.

    Each repetition writes a real run record to a scratch directory: retirement's cost is writing the finished
    requests' records, and a calibration that kept them in memory would measure a cheaper retirement than a
    real run pays. A stationarity run's repetitions each start after `settle_s` of idle, with the SM clock read
    just before and after (what the GPU's state was is then in the points file, not guessed).
    """
    from servecap.traces.workload import length_trace

    trace = length_trace([(0.0, p, run.budget) for p in run.prompts], {"kind": "calibration", "label": run.label})
    prefill, decode, clocks = [], [], []
    stationary = run.kind.startswith("stationary-")
    gpu = GpuState() if stationary else None
    for i in range(run.count):
        if stationary:
            gpu.idle(settle_s)
            before = gpu.sm_clock_mhz()
        with tempfile.TemporaryDirectory(prefix="calibrate-") as tmp:
            rec = engine.run(trace, Path(tmp) / "run", backend=run.backend, policy=run.policy, progress=False,
                             telemetry=False)  # the calibration records it through all of its runs
        # A fused run's steps with decode rows in them are its prefill steps too (kind `mixed`); its rows retire
        # apart, as they finished their prompts apart, so only decode runs hold every row to the end.
        # A decode run whose prompts one step cannot hold (the plan's long_rows) is prefilled in several groups:
        # its points are the steps that hold every row, from the last group's first token to the first finish.
        pre, dec = rec.steps[rec.steps.kind.isin(("prefill", "mixed"))], rec.steps[rec.steps.kind == "decode"]
        cap = engine.cfg.serving.max_num_batched_tokens
        split = run.kind == "decode" and cap is not None and run.width * run.padded_len > cap
        dec = dec[dec.rows == run.width] if split else dec
        whole = pre.n_admitted.sum() == run.width if split else pre.n_admitted.iloc[0] == run.width
        if not whole or (run.kind.endswith("decode") and ((dec.rows != run.width).any() or len(dec) < 4)):
            raise RuntimeError(f"{run.label}: the engine did not admit the run as {'its' if split else 'one'} "
                               f"group{'s' if split else ''} of {run.width} (admitted {pre.n_admitted.tolist()}); "
                               f"is its KV pool too small?")
        if stationary:
            clocks.append([before, gpu.sm_clock_mhz()])
        if i >= run.warmup:
            prefill.append([[int(s.rows), int(s.tokens), int(s.attn), float(s.end - s.start)]
                            for s in pre.itertuples()])
            decode.append(dec)
    extra = {"sm_clock_mhz": clocks, "settle_s": settle_s} if stationary else {}
    if run.kind.endswith("prefill"):
        return {"prefill": prefill, **extra}
    if run.kind == "stationary-decode":
        return {"first": (decode[0].end - decode[0].start).tolist(), "again": (decode[1].end - decode[1].start).tolist(),
                **extra}
    steps = decode[-1]
    return {"kv_tokens": steps.kv_tokens.astype(int).tolist(), "kv_max": steps.kv_max.astype(int).tolist(),
            "start": steps.start.tolist(), "end": steps.end.tolist()}
