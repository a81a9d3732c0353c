"""System samples for one rank: process CPU % and RSS always; GPU utilisation and
memory through NVML when the rank drives a CUDA device.

Runs on the agent's sender thread, never on the training thread. Every source is
optional: a missing psutil or NVML only leaves its fields None.
"""

from __future__ import annotations

import os
from typing import Any


class SystemSampler:
    def __init__(self, cuda_index: int | None) -> None:
        self._proc = None
        self._nvml = None
        self._handle = None
        try:
            import psutil

            self._proc = psutil.Process(os.getpid())
            self._proc.cpu_percent(None)  # the first call only primes the counter
        except Exception:
            self._proc = None
        if cuda_index is not None:
            self._open_nvml(cuda_index)

    def _open_nvml(self, cuda_index: int) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            physical = _physical_gpu_index(cuda_index)
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(physical)
            self._nvml = pynvml
        except Exception:
            self._nvml = None
            self._handle = None

    def sample(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "cpu_pct": None,
            "rss_mb": None,
            "gpu_util": None,
            "gpu_mem_mb": None,
            "gpu_mem_total_mb": None,
        }
        if self._proc is not None:
            try:
                out["cpu_pct"] = float(self._proc.cpu_percent(None))
                out["rss_mb"] = self._proc.memory_info().rss / 2**20
            except Exception:
                self._proc = None
        if self._nvml is not None:
            try:
                util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
                mem = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
                out["gpu_util"] = float(util.gpu)
                out["gpu_mem_mb"] = mem.used / 2**20
                out["gpu_mem_total_mb"] = mem.total / 2**20
            except Exception:
                self._nvml = None
        return out

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._nvml = None


def _physical_gpu_index(cuda_index: int) -> int:
    """NVML numbers GPUs physically; CUDA_VISIBLE_DEVICES renumbers them for torch."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not visible:
        return cuda_index
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if cuda_index < len(ids) and ids[cuda_index].isdigit():
        return int(ids[cuda_index])
    return cuda_index
