"""Shared test helpers: synthetic cost tables on disk, and the engine's own loop on a virtual clock."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from servecap.costs.model import CostModel
from servecap.costs.synthetic import constant_table, linear_table
from servecap.costs.table import save_cost_table
from servecap.core.block_pool import PoolSize
from servecap.core.config import ServingConfig
from servecap.core.recorder import Recorder
from servecap.core.policies import PADDED, PrefillPolicy
from servecap.core.scheduler import decode_shape, steps_in_blocks
from servecap.engine.serve import serve
from servecap.sim.simulator import SimConfig
from servecap.traces.records import RunRecord, RunWriter
from servecap.traces.workload import Trace

__all__ = ["constant_table", "linear_table", "write_table", "serve_virtual", "sim_config", "T1_REFIT"]

# A measured H200 table with both decode backends and no serving correction (shipped until 2026-12-06): one cost
# factor prices every step, and its decode is the closed runs' raw form.
T1_REFIT = Path(__file__).resolve().parents[1] / "results" / "calibration" / "t1" / "h200-t1-refit.json"

SIM_KNOBS = ("detail", "fast_forward", "noise_seed")  # SimConfig's own; the rest are the serving configuration's


def sim_config(**knobs) -> SimConfig:
    """A SimConfig from flat keywords: the simulator's own, a pool in blocks (pool_blocks) or GiB (pool_gib), and
    any other ServingConfig knob."""
    own = {k: knobs.pop(k) for k in SIM_KNOBS if k in knobs}
    pool = PoolSize(knobs.pop("pool_gib", None), knobs.pop("pool_blocks", None))
    return SimConfig(ServingConfig(pool=pool, **knobs), **own)


def write_table(table: dict, path: str | Path) -> Path:
    """Save a (synthetic) cost table where the CLI can load it with --table."""
    save_cost_table(table, path)
    return Path(path)


class VirtualClock:
    def __init__(self):
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def wait_until(self, t: float) -> None:
        self.t = max(self.t, t)


class CostRunner:
    """A model runner that does no work: each step takes the cost model's time for it on a virtual device, which
    runs launched steps in order. Synchronous (as on the CPU), a launch returns at its step's end; asynchronous (as
    on a GPU), at once, and the host's clock reaches a step's end when it waits for it."""

    def __init__(self, cost: CostModel, clock: VirtualClock, num_blocks: int, asynchronous: bool = False,
                 jitter: float = 0.0, seed: int = 0, stretch_end=lambda steps: 0.0):
        self.cost, self.clock, self.asynchronous = cost, clock, asynchronous
        self.stretch_end = stretch_end  # the host's time at a stretch's end, after its tokens are read, by its steps
        # Each step's time times a seeded lognormal factor of this sigma: steps that vary as a GPU's do, some
        # outlasting the one before by far (a decode step launched ahead may then run past an arrival).
        self._rng = np.random.default_rng(seed) if jitter else None
        self.jitter = jitter
        self.block_size, self.num_blocks = cost.table.block_size, num_blocks
        self.max_tokens = cost.table.max_tokens
        self.free_at = 0.0  # when the device has run every launched step
        self._ends: list[float] = []

    def _launch(self, seconds: float) -> float:
        if self._rng is not None:
            seconds *= float(self._rng.lognormal(0.0, self.jitter))
        self.free_at = max(self.clock.t, self.free_at) + seconds
        if not self.asynchronous:
            self.clock.t = self.free_at
        return self.free_at

    def prepare(self, seqs) -> None:
        pass  # no prompt ids to make

    def launch_prefill(self, work) -> None:
        self._prefill_end = self._launch(self.cost.prefill(work.shape))
        self._completes = sum(work.completes(i) for i in range(len(work.seqs)))

    def prefill_result(self) -> list[int]:
        self.clock.t = max(self.clock.t, self._prefill_end)
        return [-1] * self._completes  # no token computed: -1, as simulated

    def stretch_cap(self, rows) -> int:
        return steps_in_blocks(rows, self.block_size)

    def launch_decode(self, rows, backend: str) -> None:
        self._stretch, self._ends = (decode_shape(rows), backend), []
        self.launch_next(0)

    def launch_next(self, j: int) -> None:
        (n, kv_tokens, kv_max), backend = self._stretch
        self._ends.append(self._launch(float(self.cost.decode(backend, n, kv_tokens + n * j, kv_max + j))))

    def wait(self, j: int) -> None:
        self.clock.t = max(self.clock.t, self._ends[j])

    def stretch_result(self, steps: int) -> list[list[int]]:
        self.clock.t = max(self.clock.t, self._ends[steps - 1]) + self.stretch_end(steps)
        return [[-1] * steps for _ in range(self._stretch[0].rows)]


class RetireCostRecorder(Recorder):
    """Writing finished rows' records is the engine's retirement overhead: here retire_s of virtual time per row."""

    def __init__(self, writer: RunWriter, backend: str, clock: VirtualClock, retire_s: float):
        super().__init__(writer, backend, tokens=True)
        self.clock, self.retire_s = clock, retire_s

    def finish(self, seqs) -> None:
        self.clock.t += self.retire_s * len(seqs)
        super().finish(seqs)


def serve_virtual(trace: Trace, cost: CostModel, backend: str, max_batch: int, pool_blocks: int,
                  policy: PrefillPolicy = PADDED, asynchronous: bool = False, jitter: float = 0.0, arrivals=None,
                  **serving) -> RunRecord:
    """engine.serve.serve itself, with step times from `cost` on a virtual clock: what the simulator must match.
    `asynchronous`: launches return at once, as on a GPU (decode steps launched ahead); `jitter`: CostRunner's;
    `arrivals`: what the loop reads the trace's requests through (default: the trace, foreseen). `serving`: other
    ServingConfig knobs (admission, prefix_cache). The record's meta has what the engine's says of its
    configuration."""
    clock = VirtualClock()
    config = ServingConfig(max_batch=max_batch, prefill=policy, **serving)
    # the host's work at a stretch's end costs what the cost model says it does
    runner = CostRunner(cost, clock, pool_blocks, asynchronous, jitter,
                        stretch_end=lambda steps: cost.stretch_end_s(backend, str(config.prefill), steps))
    writer = RunWriter(None, {"kind": "engine", "backend": backend, "prefill": str(config.prefill),
                              "admission": str(config.admission), "prefix_cache": config.prefix_cache,
                              "max_batch": max_batch, "pool_blocks": pool_blocks, "block_size": runner.block_size,
                              "max_tokens": runner.max_tokens,
                              "max_num_batched_tokens": config.max_num_batched_tokens})
    _, timer = serve(trace, runner, RetireCostRecorder(writer, backend, clock, cost.retire_s), config, pool_blocks,
                     clock=clock, arrivals=arrivals)
    writer.close(decode_overruns=timer.overruns)
    return writer.record()


def run_cli(main, capsys, *argv) -> tuple[int, str, str]:
    """A command's `main` run in-process: its exit status, stdout and stderr."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:  # argparse refuses malformed options itself, with exit status 2
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


# ---- engine hooks for the CPU tests (Triton's interpreter) -------------------------------------------------
def interpreter_buckets(monkeypatch) -> None:
    """Engines built after this (until `monkeypatch` is undone) round a prefill step up to a multiple of the
    interpreter's query tile, 16 tokens, instead of the engine's 64. Under Triton's interpreter every padding token
    is one more program of each per-token kernel and more query tiles of attention, all run one after another on
    the CPU: a 1-token prompt costs 16 tokens' work instead of 64, a 40-token chunk 48 instead of 64. What a step
    computes for its real tokens does not depend on its bucket (the padding attends within itself and is never
    stored), and steps still run padded up to their buckets, so the padding stays covered
    (test_a_prefill_bucket_longer_than_the_models_positions_stays_inside_them keeps the engine's own buckets).
    Nothing changes with a GPU: its engine keeps its buckets, and its graphs."""
    import torch

    import servecap.engine.model_runner as model_runner
    from servecap.engine.kernels.prefill_attention import INTERPRET_BLOCK_M

    if torch.cuda.is_available():
        return

    def buckets(max_tokens: int, graph_tokens: int = model_runner.GRAPH_TOKENS) -> list[int]:
        return list(range(INTERPRET_BLOCK_M, max_tokens + INTERPRET_BLOCK_M, INTERPRET_BLOCK_M))

    monkeypatch.setattr(model_runner, "prefill_buckets", buckets)


class StepReplay:
    """Runs each distinct engine step's kernels once: a prefill or decode step whose inputs are the same as a step
    this engine already ran gets that step's results again, its tokens and the K/V it wrote, instead of the
    interpreter running the same kernels on the same numbers for tens of seconds.

    The same means: the step's whole input buffers (token ids, positions, slots, sequence bounds, the attention
    kernel's work list, block tables), the decode backend, and every pool position the step reads (each decode
    row's cached tokens; each prefill sequence's prefix in the pool), byte for byte. Nothing else enters a step's
    results: the kernels are deterministic, read nothing else, and mask what they load past a row's tokens.
    The gate runs such steps often: the padded and dense backends' padded prefill steps (the backend only decodes),
    a single prompt under padded, packed and chunked prefill where the chunk holds the prompt. Where the
    scheduler put a step differently (other slots, another group), its inputs differ and the kernels run.

    The parity gate's reference (engine/parity.py) also runs each prompt through the engine's prefill path outside
    the pool (dense_logits), for its logit difference; a prompt's is the same in every scenario, so it is computed
    once per prompt.

    `replayed` and `ran` count the steps each way. Only for an engine under the interpreter (on a GPU the steps
    replay CUDA graphs, and nothing here is installed)."""

    def __init__(self, engine):
        import torch

        self.torch, self.runner = torch, engine.runner
        self.memo: dict[bytes, tuple] = {}
        self.replayed = self.ran = 0
        if engine.device.type == "cuda":
            return
        r = self.runner
        self._prefill, self._decode = r._prefill_forward, r._decode_forward
        r._prefill_forward, r._decode_forward = self.prefill_forward, self.decode_forward
        model = engine.model
        dense_logits, logits = model.dense_logits, {}

        def once_per_prompt(ids, block_size: int = 16):
            key = (ids.cpu().numpy().tobytes(), tuple(ids.shape), block_size)
            if key not in logits:
                logits[key] = dense_logits(ids, block_size)
            return logits[key]
        model.dense_logits = once_per_prompt

    def counts(self) -> tuple[int, int]:
        return self.ran, self.replayed

    def _pool_at(self, slots):
        """K and V at these slots of the pool: [slots, layers, kv heads, head dim] each."""
        r, t = self.runner, self.torch
        s = t.as_tensor(slots, dtype=t.int64)
        b, o = s // r.block_size, s % r.block_size
        return r.k_cache[:, b, :, o, :].clone(), r.v_cache[:, b, :, o, :].clone()

    def _store(self, slots, kv) -> None:
        r, t = self.runner, self.torch
        s = t.as_tensor(slots, dtype=t.int64)
        b, o = s // r.block_size, s % r.block_size
        r.k_cache[:, b, :, o, :], r.v_cache[:, b, :, o, :] = kv

    def _slots(self, table, n: int):
        """The pool slots of a sequence's first n positions, through its block table."""
        import numpy as np

        p = np.arange(n)
        return np.asarray(table)[p // self.runner.block_size] * self.runner.block_size + p % self.runner.block_size

    def _key(self, kind, tensors, read_slots) -> bytes:
        import hashlib

        import numpy as np

        h = hashlib.blake2b(repr(kind).encode())
        for x in tensors:
            h.update(x.cpu().numpy().tobytes())
            h.update(repr(tuple(x.shape)).encode())
        if len(read_slots):
            for x in self._pool_at(np.concatenate(read_slots)):
                h.update(x.numpy().tobytes())
        return h.digest()

    def _step(self, key, written, run, out) -> None:
        hit = self.memo.get(key)
        if hit is not None:
            tokens, kv = hit
            out.copy_(tokens)
            if len(written):
                self._store(written, kv)
            self.replayed += 1
            return
        run()
        self.memo[key] = (out.clone(), self._pool_at(written) if len(written) else None)
        self.ran += 1

    def decode_forward(self, rows: int, backend: str) -> None:
        r = self.runner
        lens = r.lens[:rows].tolist()
        tables = r.tables[:rows].cpu().numpy()
        # Each row reads its first len - 1 positions from the pool and writes the last (its input token's K/V).
        read = [self._slots(tables[i], n - 1) for i, n in enumerate(lens)]
        key = self._key(("decode", backend, rows), [r.ids[:rows], r.pos[:rows], r.lens[:rows], r.slots[:rows],
                                                   r.tables[:rows]], read)
        written = r.slots[:rows].cpu().numpy()
        self._step(key, written, lambda: self._decode(rows, backend), r.out_tokens[:rows])

    def prefill_forward(self, bucket: int, inputs=None, fused: bool = False) -> None:
        assert inputs is not None, "a CPU engine's prefill steps run eagerly, with their inputs"
        ids, pos, slots, start, length, bseq, bq, last, prefix, kv_lens, tables = inputs
        # Only a sequence with a prefix (a chunk's earlier positions) reads its block table, and the pool through it,
        # and a fused step's decode row its K/V before the token it writes now; the other rows of the table hold
        # whatever an earlier step left there.
        chunks = [(i, n) for i, n in enumerate(prefix.tolist()) if n > 0]
        chunks += [(i, n - 1) for i, n in enumerate(kv_lens.tolist()) if n > 1] if fused else []
        read = [self._slots(tables[i].cpu().numpy(), n) for i, n in chunks]
        key = self._key(("prefill", bucket, fused), [ids, pos, slots, start, length, bseq, bq, last, prefix, kv_lens,
                                                     *(tables[i] for i, _ in chunks)], read)
        s = slots.cpu().numpy()
        written = s[s >= 0]
        self._step(key, written, lambda: self._prefill(bucket, inputs, fused), self.runner.prefill_tokens)


def interpreted_replica(*args, **kwargs) -> None:
    """servecap.engine.fleet's replica process with the test suite's interpreter (tests/fast_interpreter.py) and
    16-token prefill buckets (interpreter_buckets): a fleet's replicas are processes of their own, spawned, which
    import nothing of the tests' unless their target does. Set as servecap.engine.fleet._replica in the test's
    process, it is pickled by name and imported in each replica (from the path the parent gives a spawned process),
    where servecap.engine.fleet._replica is the engine's own again."""
    import pytest

    import servecap.engine.kernels  # noqa: F401  (before triton, as in any process)
    import fast_interpreter
    import servecap.engine.fleet

    fast_interpreter.install()
    interpreter_buckets(pytest.MonkeyPatch())  # for the life of this process
    servecap.engine.fleet._replica(*args, **kwargs)
