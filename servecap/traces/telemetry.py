"""GPU telemetry beside a run record: the file's format, reading it, and joining it to the steps by time.

telemetry.csv, in the run's directory (or beside a cost table), one row per sample: `time` on the run's clock (the
seconds its steps' start and end are on), `unix_time`, the SM clock (MHz), the GPU's temperature (C) and its power
draw (W). A run whose GPU could not be sampled (no GPU, neither pynvml nor nvidia-smi) has no file, and its
metadata says `telemetry: unavailable`. servecap/engine/telemetry.py writes the file.
"""
from __future__ import annotations

from pathlib import Path

FILE = "telemetry.csv"
FIELDS = ("time", "unix_time", "sm_clock_mhz", "temperature_c", "power_w")
VALUES = FIELDS[2:]
UNAVAILABLE = "unavailable"


def read_telemetry(path: str | Path):
    """A telemetry file (or a run directory holding one) as a DataFrame sorted by time; None where there is none."""
    import pandas as pd

    path = Path(path)
    if path.is_dir():
        path = path / FILE
    if not path.exists():
        return None
    df = pd.read_csv(path)
    missing = [c for c in FIELDS if c not in df.columns]
    if missing:
        from .errors import InputError
        raise InputError(f"is not a telemetry file (no column {', '.join(missing)})", path=path)
    return df.sort_values("time", kind="stable").reset_index(drop=True)


def join_steps(steps, telemetry):
    """The steps with the telemetry sample last taken at or before each step's start (NaN before the first sample,
    or with no telemetry at all)."""
    import pandas as pd

    steps = steps.reset_index(drop=True)
    if telemetry is None or not len(telemetry):
        return steps.assign(**{c: float("nan") for c in VALUES})
    order = steps["start"].argsort(kind="stable")
    joined = pd.merge_asof(steps.iloc[order].assign(_row=order.to_numpy()), telemetry[["time", *VALUES]],
                           left_on="start", right_on="time", direction="backward").drop(columns="time")
    return joined.sort_values("_row").drop(columns="_row").reset_index(drop=True)


def summarize(telemetry) -> dict:
    """What a table or a report says about a recording: samples, SM clock min / median / max, hottest, most power."""
    if telemetry is None or not len(telemetry):
        return {"source": UNAVAILABLE}
    clock = telemetry["sm_clock_mhz"]
    return {"samples": int(len(telemetry)), "sm_clock_mhz": [float(clock.min()), float(clock.median()),
                                                             float(clock.max())],
            "temperature_c_max": float(telemetry["temperature_c"].max()),
            "power_w_max": float(telemetry["power_w"].max())}
