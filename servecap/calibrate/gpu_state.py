"""The GPU's state between measured runs: an idle wait that every repetition starts from, and the SM clock.

The clock is read through NVML (nvidia-ml-py) when it is importable and a GPU answers; elsewhere (a CPU run, a
machine without NVML) it reads as None and the record says nothing was measured.
"""
from __future__ import annotations

import time


class GpuState:
    def __init__(self, index: int | None = None):
        self._handle = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = _handle(pynvml, index)
        except Exception:  # no NVML or no GPU here: clocks are simply not recorded
            self._handle = None

    def sm_clock_mhz(self) -> int | None:
        if self._handle is None:
            return None
        try:
            return int(self._nvml.nvmlDeviceGetClockInfo(self._handle, self._nvml.NVML_CLOCK_SM))
        except Exception:
            return None

    @staticmethod
    def idle(seconds: float) -> None:
        """Wait for the queued GPU work to finish, then leave the GPU idle for `seconds` (on a CPU run, nothing:
        there is no clock to recover)."""
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
            time.sleep(seconds)


def _handle(nvml, index: int | None):
    """The NVML handle of the GPU this process computes on: NVML numbers GPUs its own way (not by
    CUDA_VISIBLE_DEVICES), so the device is matched by UUID."""
    if index is not None:
        return nvml.nvmlDeviceGetHandleByIndex(index)
    import torch

    uuid = str(torch.cuda.get_device_properties(0).uuid)
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        got = nvml.nvmlDeviceGetUUID(h)
        if (got.decode() if isinstance(got, bytes) else got).removeprefix("GPU-") == uuid.removeprefix("GPU-"):
            return h
    return None
