"""The engine: loads the model, sizes the KV pool, compiles the kernels and captures the prefill and decode graphs
(all before the first step, so no step pays for any of it), and runs traces."""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Callable
from pathlib import Path

import torch

from servecap.costs.shapes import BACKENDS, backend_named
from servecap.costs.table import MIXED_DECODE_KEY
from servecap.traces.errors import InputError
from servecap.traces.model_spec import kv_bytes_per_token
from servecap.traces.provenance import gpu_matches, provenance
from servecap.traces.records import RunRecord, RunWriter
from servecap.traces.workload import Trace
from servecap.core.block_pool import PoolSize, blocks_for, gib_of
from servecap.core.config import ServingConfig
from servecap.core.recorder import Recorder
from servecap.core.policies import PREFILL

from .model_runner import EAGER_BUCKET, GRAPH_TOKENS, STRETCH_STEPS, ModelRunner
from .qwen2 import PagedQwen2
from .serve import AHEAD, MARGIN_STEPS, WallClock, serve
from .telemetry import record_run
from .weights import load_model

GRAPH_RESERVE_BYTES = 2 << 30  # CUDA graphs' private memory and allocator slack, kept out of the default pool
POOL_FRACTION = 0.9


@dataclass
class EngineConfig:
    """The serving configuration the engine is built for (its rows and pool are the most a run may use; an
    unbounded pool is what the GPU's free memory holds), and what only a real engine has."""

    serving: ServingConfig = field(default_factory=ServingConfig)
    max_prompt: int = 4096
    max_budget: int = 256
    backends: tuple[str, ...] = BACKENDS
    checkpoint: str | None = None
    seed: int = 0
    device: str = "cuda"
    expect_gpu: str | None = None

    @property
    def max_tokens(self) -> int:
        return self.max_prompt + self.max_budget

    @property
    def max_step_tokens(self) -> int:
        """The most positions a prefill step computes: a full group of the longest prompts, or the step cap."""
        full, cap = self.serving.max_batch * self.max_prompt, self.serving.max_num_batched_tokens
        return full if cap is None else min(full, cap)


def device_info(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"name": "cpu", "memory_gib": None, "cuda": None}
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    return {"name": props.name, "uuid": f"GPU-{uuid}" if uuid is not None else None, "memory_gib": round(props.total_memory / 2**30, 2),
            "cuda": torch.version.cuda, "sms": props.multi_processor_count}


def check_device(cfg: EngineConfig) -> torch.device:
    """Refuse a device other than the one the user named, before any work."""
    dev = torch.device(cfg.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError("no CUDA GPU is visible: the engine's real runs and calibration need one "
                         "(run on a GPU machine, or use the Modal A10 path: `modal run servecap/calibrate/modal_app.py`)")
    if cfg.expect_gpu:
        name = device_info(dev)["name"]
        if not gpu_matches(name, cfg.expect_gpu):
            raise InputError(f"this device is {name!r}, not the expected {cfg.expect_gpu!r}; refusing to run")
    return dev


class Engine:
    def __init__(self, cfg: EngineConfig, log=print):
        t0 = time.perf_counter()
        self.cfg = cfg
        serving = cfg.serving
        dev = check_device(cfg)
        dtype = getattr(torch, serving.dtype)
        log(f"loading {serving.spec['name']} ({'checkpoint ' + cfg.checkpoint if cfg.checkpoint else 'random weights'}) "
            f"in {serving.dtype} on {device_info(dev)['name']}")
        self.loaded = load_model(cfg.checkpoint, serving.spec, cfg.seed, dtype, dev)
        self.model = PagedQwen2(self.loaded, cfg.max_tokens)
        self.peak_prefill_bytes = self._largest_prefill() if dev.type == "cuda" else 0
        num_blocks = self._pool_blocks(dev)
        log(f"KV pool: {num_blocks} blocks of {serving.block_size} tokens "
            f"({gib_of(num_blocks, serving.block_size, self.kv_bytes_per_token):.2f} GiB); "
            f"largest prefill transient {self.peak_prefill_bytes / 2**30:.2f} GiB; capturing prefill and decode graphs")
        self.runner = ModelRunner(self.model, num_blocks, serving.block_size, serving.max_batch, cfg.max_tokens,
                                  cfg.max_step_tokens, cfg.backends)
        if dev.type == "cuda":
            self._largest_prefill()  # proves the largest group still fits beside the pool and the graphs
            torch.cuda.synchronize()
        self.device = dev
        self.start_s = time.perf_counter() - t0
        log(f"engine ready in {self.start_s:.1f} s ({len(self.runner.prefill_graphs)} prefill, "
            f"{len(self.runner.mixed_graphs)} fused and {len(self.runner.graphs)} decode graphs)")

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.loaded.spec, self.cfg.serving.dtype)  # a checkpoint's own shapes

    def _largest_prefill(self) -> int:
        """Run the largest prefill step the configuration allows (as many of the longest prompts as the step
        holds); return its transient peak in bytes.

        It writes nothing to a pool (every slot is -1), so it can run before the pool exists.
        """
        cfg = self.cfg
        width = min(cfg.max_prompt, cfg.max_step_tokens)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        self.model.dense_logits(torch.zeros((cfg.max_step_tokens // width, width), dtype=torch.int64),
                                cfg.serving.block_size)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    def _pool_blocks(self, dev: torch.device) -> int:
        cfg, serving = self.cfg, self.cfg.serving
        if serving.pool.unbounded and dev.type == "cuda":  # the engine's own: what the GPU's free memory holds
            free, _ = torch.cuda.mem_get_info(dev)
            budget = POOL_FRACTION * (free - self.peak_prefill_bytes - GRAPH_RESERVE_BYTES)
            n = PoolSize(gib=max(budget, 1) / 2**30).num_blocks(
                serving.block_size, self.kv_bytes_per_token, serving.max_batch, cfg.max_tokens)
        else:  # given; or, with no memory to measure, enough that memory never binds
            n = serving.pool.num_blocks(serving.block_size, self.kv_bytes_per_token, serving.max_batch, cfg.max_tokens)
        need = blocks_for(cfg.max_tokens, serving.block_size)
        if n < need:
            raise InputError(f"a KV pool of {n} blocks ({gib_of(n, serving.block_size, self.kv_bytes_per_token):.3f} "
                             f"GiB) cannot hold the largest request: {cfg.max_prompt} + {cfg.max_budget} tokens need "
                             f"{need} blocks of {serving.block_size}")
        return n

    def metadata(self) -> dict:
        cfg, m, r = self.cfg, self.loaded, self.runner
        return {"kind": "engine", "max_batch": cfg.serving.max_batch, "pool_blocks": r.num_blocks,
                "block_size": cfg.serving.block_size, "max_tokens": cfg.max_tokens,
                "model": {"name": m.spec["name"], "config_hash": m.config_hash, "weights": m.weights,
                          "dtype": cfg.serving.dtype},
                "device": device_info(self.device), "prefill_peak_gib": round(self.peak_prefill_bytes / 2**30, 3),
                "engine": {"start_s": round(self.start_s, 2), "policies": list(PREFILL),
                           "prefill_attention": "triton varlen (servecap/engine/kernels/prefill_attention.py)",
                           "prefill_buckets": r.buckets, "prefill_block_m": r.block_m,
                           MIXED_DECODE_KEY: "paged",
                           "prefill_graph_buckets": sorted(r.prefill_graphs), "graph_tokens": GRAPH_TOKENS,
                           "eager_bucket": EAGER_BUCKET,
                           "decode_stretch": {"ahead": AHEAD if r.asynchronous else 1, "margin_steps": MARGIN_STEPS,
                                              "max_steps": STRETCH_STEPS, "first_behind_prefill": r.asynchronous}},
                **provenance()}

    def close(self) -> None:
        """Give the GPU memory back (the graphs, the pool), so another engine can start in this process."""
        self.runner = self.model = self.loaded = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def run(self, trace: Trace, out_dir: str | Path | None, backend: str = "paged", tokens: bool = True,
            pool_blocks: int | None = None, max_batch: int | None = None, progress: bool = True,
            extra_meta: dict | None = None, policy: str = "padded", arrivals=None, replica: int = 0,
            clock=None, on_finish: Callable[[list[int]], None] | None = None, telemetry: bool = True,
            admission: str = "reserve", prefix_cache: bool = False,
            max_num_batched_tokens: int | None = None) -> RunRecord:
        """Replay `trace` in real time from now; rows are appended to `out_dir` as they complete.

        `pool_blocks` and `max_batch` may narrow the engine's own for this run (a smaller pool, fewer rows). As a
        replica behind a router (servecap/engine/fleet.py), `arrivals` hands over the requests routed here as they come,
        `clock` is the fleet's, and `trace` is the whole fleet's (its metadata). `on_finish` gets the ids of the
        requests each step finished. `policy`, `admission`, `prefix_cache` and the per-step token cap
        `max_num_batched_tokens` (None: the engine's; at most the largest step it was built for) are the scheduler's
        (servecap/core/policies.py, servecap/core/prefix_cache.py). With `telemetry` the GPU's clock, temperature and power are
        sampled into out_dir's telemetry.csv through the run (servecap/engine/telemetry.py).
        """
        backend = backend_named(backend)
        if backend not in self.cfg.backends:
            raise InputError(f"backend {backend!r} was not compiled at engine start ({', '.join(self.cfg.backends)})")
        max_batch = max_batch or self.cfg.serving.max_batch
        if max_batch > self.cfg.serving.max_batch:
            raise InputError(f"max batch {max_batch} is above the engine's {self.cfg.serving.max_batch}")
        cap = max_num_batched_tokens or self.cfg.serving.max_num_batched_tokens
        if cap is not None and cap > self.cfg.max_step_tokens:
            raise InputError(f"a step cap of {cap} tokens is above the engine's largest prefill step "
                             f"({self.cfg.max_step_tokens})")
        serving = self.cfg.serving.but(backend=backend, max_batch=max_batch, prefill=policy, admission=admission,
                                       prefix_cache=prefix_cache, max_num_batched_tokens=cap)
        pool_blocks = pool_blocks or self.runner.num_blocks
        if pool_blocks > self.runner.num_blocks:
            raise InputError(f"pool of {pool_blocks} blocks is larger than the engine's {self.runner.num_blocks}")
        telemetry = record_run(out_dir if telemetry else None, device_info(self.device))
        meta = {**self.metadata(), "backend": backend, "prefill": str(serving.prefill),
                "admission": str(serving.admission), "prefix_cache": serving.prefix_cache,
                "max_num_batched_tokens": serving.max_num_batched_tokens, "trace_id": trace.trace_id,
                "trace": trace.meta, "max_batch": max_batch, "pool_blocks": pool_blocks,
                "telemetry": telemetry.source, **(extra_meta or {})}
        writer = RunWriter(out_dir, meta)
        bar = None

        def finished(done) -> None:
            if bar:
                bar.update(len(done))
            if on_finish:
                on_finish([s.req.request_id for s in done])
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(trace), desc=f"{backend} {trace.meta.get('kind', 'trace')}", unit="req", leave=False)
        clock = clock or WallClock()
        try:
            with telemetry.timed(clock.now):
                sched, timer = serve(trace, self.runner, Recorder(writer, backend, tokens, replica=replica), serving,
                                     pool_blocks, clock=clock, arrivals=arrivals, on_finish=finished)
        finally:
            if bar:
                bar.close()
        writer.close(rejected=len(writer.record().rejected) if arrivals else len(trace) - sched.submitted,
                     decode_overruns=timer.overruns)
        return writer.record()
