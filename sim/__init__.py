"""The simulator: request traces replayed through the engine's own scheduler on simulated time, with step
costs from a GPU cost table. It imports no torch.

    from calibrate.cost_model import CostModel
    from sim import SimConfig, simulate, score
    from sim.inputs import load_table
    result = simulate(poisson_trace(3.0), CostModel(load_table(path, 64)), SimConfig(max_batch=32))
    score(result.record, 3.0)  # traces.metrics.summary plus batch-row and pool occupancy

`python -m sim` runs the default sweep; `python -m sim --help` lists the commands.
"""
from .inputs import unbounded_pool
from .model import DETAILS, SimConfig, SimResult, simulate
from .scoring import occupancy, score

__all__ = ["DETAILS", "SimConfig", "SimResult", "simulate", "unbounded_pool", "occupancy", "score"]
