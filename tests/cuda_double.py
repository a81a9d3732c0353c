"""A stand-in for `torch.cuda` that fails the way CUDA does and logs who touched it.

No GPU runs in CI, so the agent's CUDA rules (docs/agent-api.md) are checked against
this double: every call is logged with the calling module, thread, pid and device; a
primary context is counted per device the first time work lands on it; the driver is
initialised by the first call (freezing CUDA_VISIBLE_DEVICES, as the real one does);
after fork any call raises "Cannot re-initialize CUDA in forked subprocess"; a stream
can be put in graph capture, during which recording an event on it raises.

`OnDevice` makes a real CPU module's parameters report a CUDA device, so the real hooks
and the real optimizer run on CPU while the agent believes the model lives on a GPU.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

_REAL_CUDA = torch.cuda
FORK_ERROR = ("Cannot re-initialize CUDA in forked subprocess. To use CUDA with "
              "multiprocessing, you must use the 'spawn' start method")


@dataclass(frozen=True)
class Call:
    api: str
    module: str  # the calling module (`traceml_agent.recorder`, `torch.optim.sgd`, ...)
    thread: str
    pid: int
    device: int | None


class StreamDouble:
    def __init__(self, device: int) -> None:
        self.device = device

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StreamDouble) and other.device == self.device

    def __hash__(self) -> int:
        return hash(self.device)


class EventDouble:
    """Created without any CUDA call (as torch.cuda.Event is: lazily, at record)."""

    def __init__(self, cuda: CudaDouble) -> None:
        self.cuda = cuda
        self.device: int | None = None
        self.t_ns: int | None = None

    def record(self, stream: StreamDouble | None = None) -> None:
        cuda = self.cuda
        device = cuda._current() if stream is None else stream.device
        cuda._api("Event.record", device, opens_context=True)
        if cuda.capturing == device:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.device = device
        self.t_ns = cuda.device_clock()

    def query(self) -> bool:
        self.cuda._api("Event.query", self.device)
        return not self.cuda.stuck

    def elapsed_time(self, end: EventDouble) -> float:
        self.cuda._api("Event.elapsed_time", self.device)
        if self.t_ns is None or end.t_ns is None:
            raise RuntimeError("event not recorded")
        return (end.t_ns - self.t_ns) / 1e6

    def synchronize(self) -> None:
        self.cuda._api("Event.synchronize", self.device)
        if self.cuda.stuck:
            raise AssertionError("synchronize() on a stuck device never returns")


class CudaDouble:
    def __init__(self, devices: int = 2, device_clock: Callable[[], int] | None = None) -> None:
        import time

        self.devices = devices
        self.device_clock = device_clock or time.perf_counter_ns
        self.calls: list[Call] = []
        self.contexts: set[int] = set()  # devices with a primary context in this process
        self.visible_at_init: str | None = None
        self.capturing: int | None = None  # the device whose current stream captures
        self.stuck = False  # events never complete (a GPU stuck in a collective)
        # torch's caching allocator counters per device (bytes): host memory, read under
        # the allocator's lock, no driver call. Reads are logged apart from CUDA calls.
        self.allocated: dict[int, tuple[int, int]] = {}  # device -> (current, peak)
        self.reserved: dict[int, int] = {}
        self.host_reads: list[Call] = []
        self._initialized = False
        self._pid = os.getpid()
        self._tls = threading.local()

    # --- what torch.cuda offers ------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        """torch's own internals read private names (types such as
        _CudaDeviceProperties): those come from the real module. A public name the
        double lacks fails loudly, so an unmodelled call is never silently real."""
        if name.startswith("_"):
            return getattr(_REAL_CUDA, name)
        raise AttributeError(f"the CUDA double has no {name!r}")

    def is_initialized(self) -> bool:  # a Python flag in torch: not a CUDA call
        return self._initialized and os.getpid() == self._pid

    def is_available(self) -> bool:
        self._api("is_available", None)
        return True

    def device_count(self) -> int:
        self._api("device_count", None)
        return self.devices

    def current_device(self) -> int:
        self._api("current_device", None)
        return self._current()

    def set_device(self, device: Any) -> None:
        index = _index(device)
        self._api("set_device", index, opens_context=True)
        self._tls.device = index

    @contextlib.contextmanager
    def device(self, device: Any) -> Iterator[None]:
        """As torch's: switch, then switch back without opening a context on the old
        device (torch's _maybe_exchange_device)."""
        index = _index(device)
        self._api("device", index)
        old = self._current()
        self._tls.device = index
        try:
            yield
        finally:
            self._tls.device = old

    def current_stream(self, device: Any = None) -> StreamDouble:
        index = self._current() if device is None else _index(device)
        self._api("current_stream", index)
        return StreamDouble(index)

    def is_current_stream_capturing(self) -> bool:
        index = self._current()
        self._api("is_current_stream_capturing", index, opens_context=True)
        return self.capturing == index

    def Event(self, enable_timing: bool = False) -> EventDouble:  # noqa: N802 - torch's name
        return EventDouble(self)

    def get_device_properties(self, device: Any) -> Any:
        index = _index(device)
        self._api("get_device_properties", index)
        return type("Props", (), {"uuid": f"0000000{index}-0000-0000-0000-000000000000"})()

    def manual_seed_all(self, seed: int) -> None:
        """Deferred by torch until CUDA is initialised (and never in a forked child,
        where torch.cuda.is_initialized() is False): DataLoader workers call it."""
        if self.is_initialized():
            self._api("manual_seed_all", None)

    def synchronize(self, device: Any = None) -> None:
        self._api("synchronize", self._current() if device is None else _index(device))

    def memory_stats_as_nested_dict(self, device: Any = None) -> dict[str, Any]:
        """As torch's: {} before CUDA is initialised (and so in a forked child); with an
        explicit index, no driver call (torch._C._cuda_memoryStats reads the caching
        allocator's counters). Without one it would ask current_device()."""
        if not self.is_initialized():
            return {}
        index = self.current_device() if device is None else _index(device)
        self.host_reads.append(Call("memory_stats", _calling_module(),
                                    threading.current_thread().name, os.getpid(), index))
        current, peak = self.allocated.get(index, (0, 0))
        return {"allocated_bytes": {"all": {"current": current, "peak": peak}},
                "reserved_bytes": {"all": {"current": self.reserved.get(index, 0)}}}

    # --- what the test's "script" does --------------------------------------------------

    def script_uses(self, device: int) -> None:
        """The script's own first CUDA work (e.g. `model.to(f"cuda:{i}")`)."""
        self._api("script", device, opens_context=True, caller="script")

    def agent_calls(self) -> list[Call]:
        return [c for c in self.calls if c.module.startswith("traceml_agent")]

    # --- internals ----------------------------------------------------------------------

    def _current(self) -> int:
        return getattr(self._tls, "device", 0)

    def _api(self, api: str, device: int | None, opens_context: bool = False,
             caller: str | None = None) -> None:
        if os.getpid() != self._pid and self._initialized:
            raise RuntimeError(FORK_ERROR)
        if not self._initialized:
            self._initialized = True
            self.visible_at_init = os.environ.get("CUDA_VISIBLE_DEVICES")
        if opens_context and device is not None:
            self.contexts.add(device)
        module = caller or _calling_module()
        self.calls.append(Call(api, module, threading.current_thread().name, os.getpid(),
                               device))


def _index(device: Any) -> int:
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        device = torch.device(device)
    return 0 if device.index is None else device.index


def _calling_module() -> str:
    """The first module outside this file (and contextlib) on the stack: who made the
    CUDA call."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__") in (__name__, "contextlib"):
        frame = frame.f_back
    return "?" if frame is None else frame.f_globals.get("__name__", "?")


def on_device(module: nn.Module, index: int) -> nn.Module:
    """Make `module`'s parameters report cuda:`index` (they stay CPU tensors)."""
    cls = type(f"OnCuda{index}", (nn.Parameter,), {
        "device": property(lambda self: torch.device("cuda", index)),
        "is_cuda": property(lambda self: True),
    })
    for sub in module.modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            setattr(sub, name, cls(p.detach().clone(), requires_grad=p.requires_grad))
    return module
