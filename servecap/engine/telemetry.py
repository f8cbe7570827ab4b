"""Recording the GPU's SM clock, temperature and power through an engine run or a calibration (servecap/traces/telemetry.py
has the file's format).

A step's cost depends on the power the steps before it drew (the clock drops after a compute-bound burst), so the
clock is recorded beside every run rather than guessed. pynvml where it imports; else `nvidia-smi -lms 200` in a
background process; with neither, or no GPU, nothing is sampled and the record says so. Samples are taken on a
thread and written row by row (an interrupted run keeps what was sampled); the run's clock stamps each, so the
steps join them by time. No torch here.
"""
from __future__ import annotations

import csv
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Protocol

from servecap.traces.telemetry import FIELDS, FILE, UNAVAILABLE, read_telemetry, summarize

PERIOD_S = 0.2


class Sampler(Protocol):
    source: str

    def samples(self, period_s: float, stop: threading.Event) -> Iterator[tuple[float, float, float]]:
        """(SM clock MHz, temperature C, power W) about every period_s, until stop is set or the source ends."""

    def close(self) -> None: ...


class NvmlSampler:
    source = "pynvml"

    def __init__(self, uuid: str | None):
        import pynvml
        pynvml.nvmlInit()
        self._nvml = pynvml
        self._h = pynvml.nvmlDeviceGetHandleByUUID(uuid) if uuid else pynvml.nvmlDeviceGetHandleByIndex(0)

    def samples(self, period_s: float, stop: threading.Event) -> Iterator[tuple[float, float, float]]:
        n = self._nvml
        while not stop.is_set():
            yield (float(n.nvmlDeviceGetClockInfo(self._h, n.NVML_CLOCK_SM)),
                   float(n.nvmlDeviceGetTemperature(self._h, n.NVML_TEMPERATURE_GPU)),
                   n.nvmlDeviceGetPowerUsage(self._h) / 1000.0)  # mW
            stop.wait(period_s)

    def close(self) -> None:
        self._nvml.nvmlShutdown()


def smi_command(uuid: str | None, period_s: float = PERIOD_S) -> list[str]:
    return ["nvidia-smi", "--query-gpu=clocks.sm,temperature.gpu,power.draw", "--format=csv,noheader,nounits",
            "-lms", str(int(period_s * 1000)), *(["-i", uuid] if uuid else [])]


def parse_smi(line: str) -> tuple[float, float, float] | None:
    """One `nvidia-smi --format=csv,noheader,nounits` line; None for one it could not fill ('[N/A]')."""
    try:
        clock, temp, power = (float(v) for v in line.strip().split(","))
    except ValueError:
        return None
    return clock, temp, power


class SmiSampler:
    """nvidia-smi's own loop in a background process, started by the recording's thread (so that a run refused
    before it starts leaves no process behind) and ended by close()."""

    source = "nvidia-smi"

    def __init__(self, uuid: str | None, period_s: float = PERIOD_S):
        self._command = smi_command(uuid, period_s)
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._closed = False

    def samples(self, period_s: float, stop: threading.Event) -> Iterator[tuple[float, float, float]]:
        with self._lock:
            if self._closed:
                return
            try:
                self._proc = subprocess.Popen(self._command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                              text=True)
            except OSError:
                return
        for line in self._proc.stdout:  # ends when close() ends the process
            if stop.is_set():
                return
            got = parse_smi(line)
            if got is not None:
                yield got

    def close(self) -> None:
        with self._lock:
            self._closed, proc = True, self._proc
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()


def open_sampler(device: dict) -> Sampler | None:
    """A sampler for the run's GPU (device: engine.engine.device_info's, with its UUID), or None on a CPU."""
    if device.get("name", "cpu") == "cpu":
        return None
    try:
        return NvmlSampler(device.get("uuid"))
    except Exception:  # not installed, or no driver it can talk to: nvidia-smi may still answer
        pass
    return SmiSampler(device.get("uuid")) if shutil.which("nvidia-smi") else None


class Recording:
    """Samples `sampler` into `path` (FIELDS, row by row) from __enter__ to __exit__, stamped by the clock given to
    timed() (the run's seconds; unix time until then). With no sampler or no path it records nothing and `source`
    says unavailable."""

    def __init__(self, path: Path | None, sampler: Sampler | None, period_s: float = PERIOD_S):
        self.path, self.sampler, self.period_s = path, sampler, period_s
        self.clock: Callable[[], float] = time.time
        self.rows = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def source(self) -> str:
        return self.sampler.source if self.sampler is not None and self.path is not None else UNAVAILABLE

    def _record(self) -> None:
        new = not Path(self.path).exists()  # a resumed calibration appends to what it sampled before
        with open(self.path, "a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(FIELDS)
                f.flush()
            for clock, temp, power in self.sampler.samples(self.period_s, self._stop):
                w.writerow((f"{self.clock():.6f}", f"{time.time():.6f}", clock, temp, power))
                f.flush()
                self.rows += 1

    def summary(self) -> dict:
        """Where the samples came from and what they show (traces.telemetry.summarize), for a table or a log."""
        if self.source == UNAVAILABLE:
            return {"source": UNAVAILABLE}
        return {**summarize(read_telemetry(self.path)), "source": self.source, "file": Path(self.path).name}

    def timed(self, clock: Callable[[], float]) -> "Recording":
        """Stamp the samples with `clock` (the run's clock is made after its record is opened)."""
        self.clock = clock
        return self

    def __enter__(self) -> "Recording":
        if self.source != UNAVAILABLE:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            self._thread = threading.Thread(target=self._record, name="telemetry", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:  # an NVML loop ends within a period; nvidia-smi's at its next line
            self._thread.join(timeout=2 + self.period_s)
        if self.sampler is not None:
            self.sampler.close()  # ends nvidia-smi's output, and with it a loop still waiting for a line
        if self._thread is not None:
            self._thread.join(timeout=5)


def record_run(out_dir: str | Path | None, device: dict, sampler: Sampler | None = None) -> Recording:
    """The recording for a run written to out_dir (telemetry.csv there); `sampler` overrides the GPU's own."""
    return record_to(Path(out_dir) / FILE if out_dir is not None else None, device, sampler)


def record_to(path: Path | None, device: dict, sampler: Sampler | None = None) -> Recording:
    """The recording into `path` (none: nothing recorded); `sampler` overrides the GPU's own."""
    if sampler is None and path is not None:
        sampler = open_sampler(device)
    return Recording(path, sampler)
