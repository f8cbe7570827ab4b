"""One serving configuration: every knob that decides what an engine (or a fleet of them) does with a trace, defined
once. The engine (engine.engine.EngineConfig), the simulator (sim.simulator.SimConfig), the sweep's grid, the
validation plan's points and calibration's runs each hold one of these and add only what is theirs."""
from __future__ import annotations

from dataclasses import dataclass, replace

from servecap.costs.shapes import BACKENDS, backend_named
from servecap.traces.errors import InputError
from servecap.traces.model_spec import DEFAULT_MODEL, DTYPE_BYTES, MODELS, kv_bytes_per_token

from .block_pool import DEFAULT_BLOCK_SIZE, UNBOUNDED, BlockPool, PoolSize, blocks_for
from .prefix_cache import CachingBlockPool
from .routing import ROUTERS
from .policies import PADDED, RESERVE, AdmissionPolicy, PrefillPolicy
from .scheduler import Scheduler


SINGLE_ROUTER = "round-robin"  # the router a single engine's configuration names (any router sends it everything)


def _count(value, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{what}, got {value!r}")


@dataclass(frozen=True)
class ServingConfig:
    """model: a key of traces.model_spec.MODELS; dtype: the K/V (and weights') dtype; block_size: tokens per KV
    block; max_batch: batch rows; pool: the KV pool (GiB, blocks or unbounded); backend: the decode backend;
    prefill, admission: the scheduler's policies (or their names; servecap/core/policies.py); prefix_cache: share full
    prompt blocks by content (servecap/core/prefix_cache.py); max_num_batched_tokens: the most positions one prefill
    step computes (vLLM's name; None: no cap, a group is bounded by rows and blocks alone); replicas behind `router`
    (one: a single engine)."""

    model: str = DEFAULT_MODEL
    dtype: str = "float16"
    block_size: int = DEFAULT_BLOCK_SIZE
    max_batch: int = 32
    pool: PoolSize = UNBOUNDED
    backend: str = "paged"
    prefill: PrefillPolicy = PADDED
    admission: AdmissionPolicy = RESERVE
    prefix_cache: bool = False
    max_num_batched_tokens: int | None = None
    replicas: int = 1
    router: str = SINGLE_ROUTER

    def __post_init__(self):
        if self.model not in MODELS:
            raise InputError(f"unknown model {self.model!r}; choose {', '.join(MODELS)}")
        if self.dtype not in DTYPE_BYTES:
            raise InputError(f"unknown dtype {self.dtype!r}; choose {', '.join(DTYPE_BYTES)}")
        _count(self.block_size, "the block size must be a whole number of tokens >= 1")
        _count(self.max_batch, "max batch must be a whole number of rows >= 1")
        _count(self.replicas, "a fleet needs a whole number of replicas >= 1")
        if self.max_num_batched_tokens is not None:
            _count(self.max_num_batched_tokens, "max_num_batched_tokens must be a whole number of tokens >= 1")
        object.__setattr__(self, "backend", backend_named(self.backend))  # an old plan's or command's `padded`
        if self.backend not in BACKENDS:
            raise InputError(f"unknown backend {self.backend!r}; choose {', '.join(BACKENDS)}")
        if self.router not in ROUTERS:
            raise InputError(f"unknown router {self.router!r}; choose {', '.join(ROUTERS)}")
        if self.replicas == 1:  # one engine gets every request whatever the router: one configuration, run once
            object.__setattr__(self, "router", SINGLE_ROUTER)
        if not isinstance(self.prefix_cache, bool):
            raise InputError(f"prefix_cache is on or off (True or False), got {self.prefix_cache!r}")
        if not isinstance(self.pool, PoolSize):
            raise TypeError(f"pool must be a PoolSize, got {self.pool!r}")
        # Names are parsed (once, here), so that a configuration can be written as text.
        object.__setattr__(self, "prefill", PrefillPolicy.parse(self.prefill))
        object.__setattr__(self, "admission", AdmissionPolicy.parse(self.admission))
        self.prefill.check(self.max_batch, self.max_num_batched_tokens)

    @property
    def spec(self) -> dict:
        """The model's shapes (traces.model_spec)."""
        return MODELS[self.model]

    @property
    def max_positions(self) -> int:
        """The most tokens (prompt + budget) a request may hold: the model's positions. The simulator serves them
        all; past the cost table's measured range it prices steps by the fitted model's own form, and says so."""
        return int(self.spec["max_position_embeddings"])

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.spec, self.dtype)

    def blocks_for(self, tokens: int) -> int:
        return blocks_for(tokens, self.block_size)

    def pool_blocks(self, largest_tokens: int) -> int:
        """The pool's blocks, for a workload whose largest request holds `largest_tokens` (prompt + budget)."""
        return self.pool.num_blocks(self.block_size, self.kv_bytes_per_token, self.max_batch, largest_tokens)

    def scheduler(self, num_blocks: int, max_tokens: int | None, max_batch: int | None = None) -> Scheduler:
        """A scheduler of this configuration's policies on a pool of `num_blocks` (caching when prefix_cache), for
        requests of at most `max_tokens` (None: any), with `max_batch` rows (None: the configuration's)."""
        pool = (CachingBlockPool if self.prefix_cache else BlockPool)(num_blocks, self.block_size)
        return Scheduler(max_batch or self.max_batch, pool, max_tokens, self.prefill, self.admission,
                         self.max_num_batched_tokens)

    def but(self, **changes) -> "ServingConfig":
        """This configuration with some knobs changed."""
        return replace(self, **changes)

    @property
    def label(self) -> str:
        policy = "" if self.prefill == PADDED else f", {self.prefill} prefill"
        policy += "" if self.admission == RESERVE else f", {self.admission} admission"
        policy += ", prefix cache" if self.prefix_cache else ""
        policy += f", step cap {self.max_num_batched_tokens} tokens" if self.max_num_batched_tokens else ""
        fleet = "" if self.replicas == 1 else f", {self.replicas} replicas behind {self.router}"
        return f"{self.backend}{policy}, max batch {self.max_batch}, pool {self.pool}{fleet}"

    def axes(self) -> dict:
        """The knobs a sweep varies, flat, as its rows and points files name them (a pool in GiB); the step cap
        only where there is one, so that sweeps and plans made before it existed read and resume as they were."""
        cap = {} if self.max_num_batched_tokens is None else {"max_num_batched_tokens": self.max_num_batched_tokens}
        return {"backend": self.backend, "max_batch": self.max_batch, "pool_gib": self.pool.gib,
                "prefill": str(self.prefill), "admission": str(self.admission),
                "prefix_cache": self.prefix_cache, **cap, "replicas": self.replicas,
                "router": self.router}
