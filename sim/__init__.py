"""The simulator: request traces replayed through the engine's own scheduler on simulated time, with step
costs from a GPU cost table. It imports no torch.

    from calibrate.cost_model import CostModel
    from sim import SimConfig, simulate, score
    from sim.inputs import load_table
    result = simulate(poisson_trace(3.0), CostModel(load_table(path, 64)), SimConfig(max_batch=32))
    summary(result.record, 3.0)  # traces.metrics.summary: the shared metrics, real and simulated runs alike

`python -m sim` runs the default sweep; `python -m sim --help` lists the commands.
"""
from .inputs import unbounded_pool
from .model import DETAILS, SimConfig, SimResult, simulate

__all__ = ["DETAILS", "SimConfig", "SimResult", "simulate", "unbounded_pool"]
