"""The simulator: request traces replayed through the engine's own scheduler and step loop on simulated time,
with step costs from a GPU cost table. It imports no torch.

    from costs import CostModel
    from sim import SimConfig, simulate
    from sim.inputs import load_table
    from traces.metrics import summary
    result = simulate(poisson_trace(3.0), CostModel(load_table(None, 64)), SimConfig(max_batch=32))
    summary(result.record, 3.0)  # the shared metrics, real and simulated runs alike

`python -m sim` runs the default sweep; `python -m sim --help` lists the commands.
"""
from .fleet import simulate_fleet
from .simulator import DETAILS, SimConfig, SimResult, simulate

__all__ = ["DETAILS", "SimConfig", "SimResult", "simulate", "simulate_fleet"]
