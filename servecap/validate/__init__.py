"""Validation: the simulator's predictions graded by real engine runs of the same traces.

    python -m validate plan   --out results/validation --table TABLE ...   # CPU: points and their predictions
    python -m validate real   --out results/validation                    # GPU: run them (resumes)
    python -m validate report --out results/validation --table TABLE     # CPU: predicted beside measured
"""
