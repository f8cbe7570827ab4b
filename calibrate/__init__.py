"""Calibration: measure the engine's step costs on a GPU and fit the cost model the simulator uses.

`calibrate.cost_model` imports no torch; the sweep that drives the engine does.
"""
