"""The simulator: request traces replayed through the engine's own scheduler and step loop on simulated time,
with step costs from a GPU cost table. It imports no torch.

    from servecap.costs import CostModel
    from servecap.sim import SimConfig, simulate
    from servecap.core.config import ServingConfig
    from servecap.sim.inputs import load_table
    from servecap.traces.metrics import summary
    result = simulate(poisson_trace(3.0), CostModel(load_table(None)), SimConfig(ServingConfig(max_batch=32)))
    summary(result.record, 3.0)  # the shared metrics, real and simulated runs alike

`python -m sim` runs the default sweep; `python -m sim --help` lists the commands.
"""
__all__ = ["DETAILS", "SimConfig", "SimResult", "simulate", "simulate_fleet"]


def __getattr__(name: str):
    # The simulator (numpy, SimPy, pandas) is imported when first asked for, not by `python -m sim --help`.
    if name == "simulate_fleet":
        from .fleet import simulate_fleet
        return simulate_fleet
    if name in __all__:
        from . import simulator
        return getattr(simulator, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
