"""Shared formats, workloads and metrics: request traces, run records, cost tables.

Nothing here imports torch: the simulator and the analysis run on any machine.
"""
