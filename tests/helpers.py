"""Shared test helpers: synthetic cost tables on disk, and the engine's own loop on a virtual clock."""
from __future__ import annotations

from pathlib import Path

from servecap.costs.model import CostModel
from servecap.costs.synthetic import constant_table, linear_table
from servecap.costs.table import save_cost_table
from servecap.core.block_pool import PoolSize
from servecap.core.config import ServingConfig
from servecap.core.recorder import Recorder
from servecap.core.policies import PADDED, PrefillPolicy
from servecap.core.scheduler import decode_shape
from servecap.engine.serve import serve
from servecap.sim.simulator import SimConfig
from servecap.traces.records import RunRecord, RunWriter
from servecap.traces.workload import Trace

__all__ = ["constant_table", "linear_table", "write_table", "serve_virtual", "sim_config"]

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
    """A model runner that does no work: each step advances the virtual clock by the cost model's time for it."""

    def __init__(self, cost: CostModel, clock: VirtualClock, num_blocks: int):
        self.cost, self.clock = cost, clock
        self.block_size, self.num_blocks = cost.table.block_size, num_blocks
        self.max_tokens = cost.table.max_tokens

    def prefill(self, work) -> list[int]:
        self.clock.t += self.cost.prefill(work.shape)
        return [-1] * sum(work.completes(i) for i in range(len(work.seqs)))  # no token computed: -1, as simulated

    def decode(self, rows, backend: str) -> list[int]:
        s = decode_shape(rows)
        self.clock.t += float(self.cost.decode(backend, s.rows, s.kv_tokens, s.kv_max))
        return [-1] * len(rows)


class RetireCostRecorder(Recorder):
    """Writing finished rows' records is the engine's retirement overhead: here retire_s of virtual time per row."""

    def __init__(self, writer: RunWriter, backend: str, clock: VirtualClock, retire_s: float):
        super().__init__(writer, backend, tokens=True)
        self.clock, self.retire_s = clock, retire_s

    def finish(self, seqs) -> None:
        self.clock.t += self.retire_s * len(seqs)
        super().finish(seqs)


def serve_virtual(trace: Trace, cost: CostModel, backend: str, max_batch: int, pool_blocks: int,
                  policy: PrefillPolicy = PADDED, **serving) -> RunRecord:
    """engine.serve.serve itself, with step times from `cost` on a virtual clock: what the simulator must match.
    `serving`: other ServingConfig knobs (admission, prefix_cache)."""
    clock = VirtualClock()
    writer = RunWriter(None, {})
    serve(trace, CostRunner(cost, clock, pool_blocks), RetireCostRecorder(writer, backend, clock, cost.retire_s),
          ServingConfig(max_batch=max_batch, prefill=policy, **serving), pool_blocks, clock=clock)
    return writer.record()


def run_cli(main, capsys, *argv) -> tuple[int, str, str]:
    """A command's `main` run in-process: its exit status, stdout and stderr."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:  # argparse refuses malformed options itself, with exit status 2
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err
