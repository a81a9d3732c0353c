"""System samples for one rank: process CPU % and RSS always; GPU utilisation and
memory through NVML when the rank drives a CUDA device, and this process's own
figures from torch's caching allocator beside them.

Runs on the agent's sender thread, never on the training thread. Every source is
optional: a missing psutil or NVML only leaves its fields None.

NVML's device memory counts every process on the GPU; users size batches by their own
process's allocator numbers (`memory_allocated`, `memory_reserved`, the peak), so both
are sent. The allocator's counters live in host memory and are read under its own
lock (`torch.cuda.memory_stats_as_nested_dict(index)` with an explicit index): no CUDA
driver call, no context, no sync, so they are safe off the training thread and during
a graph capture.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from . import visible_devices

METRIC_FAILURES = 3  # consecutive errors before a GPU metric is given up


class SystemSampler:
    def __init__(self, cuda_index: int | None = None) -> None:
        self.cuda_index: int | None = None
        self._proc = None
        self._nvml = None
        self._handle = None
        self._failures: dict[str, int] = {}
        self._dead: set[str] = set()
        try:
            import psutil

            self._proc = psutil.Process(os.getpid())
            self._proc.cpu_percent(None)  # the first call only primes the counter
        except Exception:
            self._proc = None
        if cuda_index is not None:
            self.open_gpu(cuda_index)

    def open_gpu(self, cuda_index: int) -> None:
        """Sample torch's device `cuda_index` from now on (NVML, never CUDA: this runs on
        the sender thread)."""
        self.close()
        self.cuda_index = cuda_index
        try:
            import pynvml

            pynvml.nvmlInit()
            visible = visible_devices.parse(os.environ.get("CUDA_VISIBLE_DEVICES"))
            self._handle = visible_devices.nvml_handle(pynvml, cuda_index, visible)
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
            "gpu_alloc_mb": None,
            "gpu_reserved_mb": None,
            "gpu_peak_mb": None,
            "device": None if self.cuda_index is None else f"cuda:{self.cuda_index}",
        }
        if self._proc is not None:
            try:
                out["cpu_pct"] = float(self._proc.cpu_percent(None))
                out["rss_mb"] = self._proc.memory_info().rss / 2**20
            except Exception:
                self._proc = None
        if self._nvml is not None:
            # Each metric on its own: utilisation is "not supported" on a MIG instance,
            # which must not take the memory figures with it.
            if "util" not in self._dead:
                try:
                    util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
                    out["gpu_util"] = float(util.gpu)
                    self._failures.pop("util", None)
                except Exception:
                    self._failed("util")
            if "mem" not in self._dead:
                try:
                    mem = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
                    out["gpu_mem_mb"] = mem.used / 2**20
                    out["gpu_mem_total_mb"] = mem.total / 2**20
                    self._failures.pop("mem", None)
                except Exception:
                    self._failed("mem")
        if self.cuda_index is not None and "alloc" not in self._dead:
            try:
                self._allocator(out, self.cuda_index)
                self._failures.pop("alloc", None)
            except Exception:
                self._failed("alloc")
        return out

    @staticmethod
    def _allocator(out: dict[str, Any], index: int) -> None:
        """This process's allocator figures for torch device `index` (see above)."""
        cuda = sys.modules["torch"].cuda  # torch is loaded once a device is learned
        stats = cuda.memory_stats_as_nested_dict(index)
        if not stats:  # torch says CUDA is not initialised (e.g. in a forked child)
            return
        allocated, reserved = stats["allocated_bytes"]["all"], stats["reserved_bytes"]["all"]
        out["gpu_alloc_mb"] = allocated["current"] / 2**20
        out["gpu_reserved_mb"] = reserved["current"] / 2**20
        out["gpu_peak_mb"] = allocated["peak"] / 2**20

    def _failed(self, metric: str) -> None:
        """A metric that failed METRIC_FAILURES times in a row is not asked again."""
        self._failures[metric] = self._failures.get(metric, 0) + 1
        if self._failures[metric] >= METRIC_FAILURES:
            self._dead.add(metric)

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._nvml = None
        self._handle = None
        self._failures.clear()
        self._dead.clear()
