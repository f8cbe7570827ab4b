"""Shared test helpers: synthetic cost tables on disk, and the engine's own loop on a virtual clock."""
from __future__ import annotations

from pathlib import Path

from calibrate.cost_model import CostModel
from engine.recorder import Recorder
from engine.serve import serve
from sim.synthetic import constant_table, linear_table
from traces.cost_table import save_cost_table
from traces.records import RunRecord, RunWriter
from traces.workload import Trace

__all__ = ["constant_table", "linear_table", "write_table", "serve_virtual"]


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
        self.block_size, self.num_blocks = cost.table["block_size"], num_blocks
        self.max_tokens = cost.table["max_tokens"]

    def prefill(self, group) -> list[int]:
        self.clock.t += self.cost.prefill(len(group), max(s.req.prompt_tokens for s in group))
        return [-1] * len(group)  # no token is computed: -1, as the simulator records

    def decode(self, rows, backend: str) -> list[int]:
        # What serve() records: every row's K/V plus the token it writes (no single-token request is running).
        kv_tokens, kv_max = sum(s.kv_len for s in rows) + len(rows), max(s.kv_len for s in rows) + 1
        self.clock.t += float(self.cost.decode(backend, len(rows), kv_tokens, kv_max))
        return [-1] * len(rows)


class RetireCostRecorder(Recorder):
    """Writing finished rows' records is the engine's retirement overhead: here retire_s of virtual time per row."""

    def __init__(self, writer: RunWriter, backend: str, clock: VirtualClock, retire_s: float):
        super().__init__(writer, backend, tokens=True)
        self.clock, self.retire_s = clock, retire_s

    def finish(self, seqs) -> None:
        self.clock.t += self.retire_s * len(seqs)
        super().finish(seqs)


def serve_virtual(trace: Trace, cost: CostModel, backend: str, max_batch: int, pool_blocks: int) -> RunRecord:
    """engine.serve.serve itself, with step times from `cost` on a virtual clock: what the simulator must match."""
    clock = VirtualClock()
    writer = RunWriter(None, {})
    serve(trace, CostRunner(cost, clock, pool_blocks), RetireCostRecorder(writer, backend, clock, cost.retire_s),
          max_batch, pool_blocks, clock=clock)
    return writer.record()
