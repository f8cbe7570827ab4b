"""Calibration: measure the engine's step costs on a GPU and write the cost table the simulator reads.

plan (the runs to make) -> measure (closed runs on the engine, kept by store in a resumable points file) -> points
(step logs to cost-table points) -> table (fit with costs.fit, overhead, held-out check in accuracy, stationarity);
refresh rescales a table to another GPU, refit rebuilds one from its points on a CPU; cli runs them, modal_app runs
cli on Modal. Only measuring imports torch (lazily); the tables' format and model live in costs/, torch-free.
"""
