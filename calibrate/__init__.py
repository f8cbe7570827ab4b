"""Calibration: measure the engine's step costs on a GPU and fit the cost model the simulator uses.

sweep (the plan, and its driver on the engine) -> store (the resumable points file) -> points, table (cost-table
points, fit, overhead) -> accuracy (the held-out check); cli runs them, modal_app runs cli on Modal's A10.
Only the driver's engine side imports torch (lazily): the simulator imports `calibrate.cost_model` without it.
"""
