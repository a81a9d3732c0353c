"""A stand-in for `torch.cuda` that fails the way CUDA does and logs who touched it.

No GPU runs in CI, so the agent's CUDA rules (docs/agent-api.md) are checked against
this double: every call is logged with the calling module, thread, pid and device; a
primary context is counted per device the first time work lands on it; the driver is
initialised by the first call (freezing CUDA_VISIBLE_DEVICES, as the real one does);
after fork any call raises "Cannot re-initialize CUDA in forked subprocess"; a stream
can be put in graph capture, during which recording an event on it raises.

It is no kinder than CUDA (issue 29):
  * graph capture has CUDA's error modes: in "global" mode an event query, an elapsed
    time, a synchronize or a pinned allocation from ANY thread raises (as
    cudaErrorStreamCaptureUnsupported does) and invalidates the capture, so the user's
    `capture_end()` raises; in "thread_local" mode only the capturing thread's calls do;
    "relaxed" allows them. `CUDAGraph` and `graph` stand in for torch's;
  * events complete `lag_ns` of device time after they are recorded (pending at step
    ends, as on a real GPU), and elapsed_time on an incomplete event raises;
  * streams: `Stream()` makes a side stream whose clock is skewed by `skew_ns`, so an
    elapsed time between events on two streams can be negative;
  * streams hold queued work (issue 40): `launch(ns)` queues a kernel of `ns` device time
    on the current stream (a graph's `work_ns` on replay), an event completes when the
    work queued before it on ITS stream has run, and `wait_stream` orders two streams.
    An event on an idle stream completes at once, however busy another stream is, as on
    a GPU: a step clock on the wrong stream measures the host's launch interval;
  * `backward_on_device_thread` runs the real backward on a thread named like autograd's
    device thread while the caller blocks (on a GPU, hooks and final callbacks run
    there); `background_batches` iterates a DataLoader on a prefetch thread.

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


CAPTURE_ERROR = ("CUDA error: operation not permitted when stream is capturing "
                 "(cudaErrorStreamCaptureUnsupported)")
INVALIDATED = "CUDA error: operation failed due to a previous error during capture"


class StreamDouble:
    """The default stream of a device (id 0), or a side stream whose events' device times
    are offset by `skew_ns` (another stream's work runs at other times)."""

    def __init__(self, device: int, ident: int = 0, skew_ns: int = 0,
                 cuda: CudaDouble | None = None) -> None:
        self.device = device
        self.ident = ident
        self.skew_ns = skew_ns
        self.cuda = cuda

    def wait_stream(self, other: StreamDouble) -> None:
        """Work queued here after this call starts after what `other` has queued now."""
        cuda = self.cuda
        assert cuda is not None, "a stream from the double's current_stream/Stream"
        cuda._api("Stream.wait_stream", self.device)
        busy = cuda.busy
        key, okey = (self.device, self.ident), (other.device, other.ident)
        busy[key] = max(busy.get(key, 0), busy.get(okey, 0))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, StreamDouble) and other.device == self.device
                and other.ident == self.ident)

    def __hash__(self) -> int:
        return hash((self.device, self.ident))


class EventDouble:
    """Created without any CUDA call (as torch.cuda.Event is: lazily, at record)."""

    def __init__(self, cuda: CudaDouble) -> None:
        self.cuda = cuda
        self.device: int | None = None
        self.t_ns: int | None = None

    def record(self, stream: StreamDouble | None = None) -> None:
        cuda = self.cuda
        if stream is None:
            stream = cuda.current_stream()
        device = stream.device
        cuda._api("Event.record", device, opens_context=True)
        if cuda.capturing == device and cuda._on_capture_stream(stream):
            cuda._invalidate()
            raise RuntimeError(CAPTURE_ERROR)
        self.device = device
        self.t_ns = cuda.queued_until(stream) + stream.skew_ns

    def _done(self) -> bool:
        cuda = self.cuda
        return (not cuda.stuck and self.t_ns is not None
                and cuda.device_clock() - self.t_ns >= cuda.lag_ns)

    def query(self) -> bool:
        self.cuda._api("Event.query", self.device, unsafe_in_capture=True)
        return self._done()

    def elapsed_time(self, end: EventDouble) -> float:
        self.cuda._api("Event.elapsed_time", self.device, unsafe_in_capture=True)
        if self.t_ns is None or end.t_ns is None:
            raise RuntimeError("event not recorded")
        if not (self._done() and end._done()):
            raise RuntimeError("CUDA error: device not ready")
        return (end.t_ns - self.t_ns) / 1e6

    def synchronize(self) -> None:
        self.cuda._api("Event.synchronize", self.device, unsafe_in_capture=True)
        if self.cuda.stuck:
            raise AssertionError("synchronize() on a stuck device never returns")


class GraphDouble:
    """torch.cuda.CUDAGraph: capture on the current stream of the current device, in one
    of CUDA's capture error modes; capture_end raises when the capture was invalidated by
    a prohibited call (from anyone) during it. Replays count."""

    cuda: CudaDouble  # set on the class the double builds

    def __init__(self) -> None:
        self.replays = 0
        self.captured = False
        self.work_ns = 0  # device time one replay queues on the current stream

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        cuda = self.cuda
        cuda._api("CUDAGraph.capture_begin", cuda._current(), caller="torch.cuda.graphs")
        if cuda.capturing is not None:
            raise RuntimeError("a capture is already in progress")
        cuda.capturing = cuda._current()
        cuda.capture_mode = capture_error_mode
        cuda.capture_thread = threading.get_ident()
        cuda.capture_invalid = None

    def capture_end(self) -> None:
        cuda = self.cuda
        invalid = cuda.capture_invalid
        cuda.capturing = cuda.capture_thread = None
        cuda.capture_mode = "global"
        cuda.capture_invalid = None
        if invalid is not None:
            raise RuntimeError(f"{INVALIDATED} ({invalid})")
        self.captured = True

    def replay(self) -> None:
        cuda = self.cuda
        cuda._api("CUDAGraph.replay", cuda._current(), caller="torch.cuda.graphs")
        if not self.captured:
            raise RuntimeError("replay() of a graph that was not captured")
        self.replays += 1
        if self.work_ns:
            cuda.launch(self.work_ns)


class GraphContextDouble:
    """torch.cuda.graph(g, pool=None, stream=None, capture_error_mode="global")."""

    cuda: CudaDouble

    def __init__(self, cuda_graph: GraphDouble, pool: Any = None, stream: Any = None,
                 capture_error_mode: str = "global") -> None:
        self.graph = cuda_graph
        self.mode = capture_error_mode

    def __enter__(self) -> None:
        self.graph.capture_begin(capture_error_mode=self.mode)

    def __exit__(self, *exc: Any) -> None:
        self.graph.capture_end()


class CudaDouble:
    def __init__(self, devices: int = 2, device_clock: Callable[[], int] | None = None) -> None:
        import time

        self.devices = devices
        self.device_clock = device_clock or time.perf_counter_ns
        self.calls: list[Call] = []
        self.contexts: set[int] = set()  # devices with a primary context in this process
        self.visible_at_init: str | None = None
        self.capturing: int | None = None  # the device whose current stream captures
        self.capture_mode = "global"  # CUDA's capture error mode: global/thread_local/relaxed
        self.capture_thread: int | None = None  # None: set by hand, any thread's stream
        self.capture_invalid: str | None = None  # the prohibited call that broke it
        self.lag_ns = 0  # device time from an event's record to its completion
        self.sticky_error: str | None = None  # a device error every later call reports
        self._streams = 0
        # Device time until which each stream, (device, ident), has work queued.
        self.busy: dict[tuple[int, int], int] = {}
        # The graph types, bound to this double (torch.cuda.CUDAGraph, torch.cuda.graph).
        self.CUDAGraph = type("CUDAGraph", (GraphDouble,), {"cuda": self})
        self.graph = type("graph", (GraphContextDouble,), {"cuda": self})
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
        return self._streams_of_thread().get(index) or StreamDouble(index, cuda=self)

    def default_stream(self, device: Any = None) -> StreamDouble:
        index = self._current() if device is None else _index(device)
        self._api("default_stream", index)
        return StreamDouble(index, cuda=self)

    def Stream(self, device: Any = None, skew_ns: int = 0) -> StreamDouble:  # noqa: N802
        index = self._current() if device is None else _index(device)
        self._api("Stream", index, opens_context=True)
        self._streams += 1
        return StreamDouble(index, self._streams, skew_ns, cuda=self)

    @contextlib.contextmanager
    def stream(self, stream: StreamDouble) -> Iterator[None]:
        """torch.cuda.stream(s): s is the current stream of its device on this thread."""
        streams = self._streams_of_thread()
        old = streams.get(stream.device)
        streams[stream.device] = stream
        try:
            yield
        finally:
            if old is None:
                streams.pop(stream.device, None)
            else:
                streams[stream.device] = old

    def is_current_stream_capturing(self) -> bool:
        """Allowed during a capture (cudaStreamIsCapturing is capture-safe)."""
        index = self._current()
        self._api("is_current_stream_capturing", index, opens_context=True)
        return self.capturing == index and self._on_capture_stream(None)

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
        self._api("synchronize", self._current() if device is None else _index(device),
                  unsafe_in_capture=True)

    def pinned_allocation(self) -> None:
        """torch.empty(..., pin_memory=True) (cudaHostAlloc), routed here by
        `patch_pinned_memory`."""
        self._api("pin_memory", None, unsafe_in_capture=True)

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

    def launch(self, ns: int, stream: StreamDouble | None = None) -> None:
        """The script queues a kernel of `ns` device time on `stream` (the current one):
        it starts when the stream's earlier work is done, or now if the stream is idle."""
        if stream is None:
            stream = self.current_stream_quiet(self._current())
        self._api("launch", stream.device, opens_context=True, caller="script")
        key = (stream.device, stream.ident)
        self.busy[key] = max(self.device_clock(), self.busy.get(key, 0)) + ns

    def queued_until(self, stream: StreamDouble) -> int:
        """When the work queued on `stream` so far is done (device time): now if idle."""
        return max(self.device_clock(), self.busy.get((stream.device, stream.ident), 0))

    def script_uses(self, device: int) -> None:
        """The script's own first CUDA work (e.g. `model.to(f"cuda:{i}")`)."""
        self._api("script", device, opens_context=True, caller="script")

    def agent_calls(self) -> list[Call]:
        return [c for c in self.calls if c.module.startswith("traceml_agent")]

    # --- internals ----------------------------------------------------------------------

    def _current(self) -> int:
        return getattr(self._tls, "device", 0)

    def _streams_of_thread(self) -> dict[int, StreamDouble]:
        streams = getattr(self._tls, "streams", None)
        if streams is None:
            streams = self._tls.streams = {}
        return streams

    def _on_capture_stream(self, stream: StreamDouble | None) -> bool:
        """Whether `stream` (None: this thread's current one) is the capturing stream: the
        capturing thread's current stream (torch.cuda.graph makes its capture stream
        current), or any stream of the device when the capture was set by hand."""
        if self.capture_thread is None:
            return True
        return threading.get_ident() == self.capture_thread and (
            stream is None or stream == self.current_stream_quiet(stream.device))

    def current_stream_quiet(self, device: int) -> StreamDouble:
        return self._streams_of_thread().get(device) or StreamDouble(device, cuda=self)

    def _invalidate(self, why: str = "a prohibited call") -> None:
        if self.capturing is not None and self.capture_invalid is None:
            self.capture_invalid = why

    def _api(self, api: str, device: int | None, opens_context: bool = False,
             caller: str | None = None, unsafe_in_capture: bool = False) -> None:
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
        if self.sticky_error is not None and caller is None:
            raise RuntimeError(f"CUDA error: {self.sticky_error}")
        if unsafe_in_capture and self.capturing is not None and self._prohibited():
            self._invalidate(f"{api} from {module}")
            raise RuntimeError(CAPTURE_ERROR)

    def _prohibited(self) -> bool:
        """CUDA's capture error modes: which threads' unsafe calls break the capture."""
        mode = self.capture_mode
        if mode == "relaxed":
            return False
        if mode == "thread_local" and self.capture_thread is not None:
            return threading.get_ident() == self.capture_thread
        return True  # global: from any thread


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


def patch_pinned_memory(monkeypatch: Any, cuda: CudaDouble) -> None:
    """torch.empty(..., pin_memory=True) asks the double first (a CPU build has no pinned
    memory): it raises during a capture as cudaHostAlloc does, else gives a CPU tensor."""
    real_empty = torch.empty

    def empty(*args: Any, pin_memory: bool = False, **kwargs: Any) -> Any:
        if pin_memory:
            cuda.pinned_allocation()
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)


AUTOGRAD_THREAD = "pt_autograd_0"  # the name PyTorch gives cuda:0's autograd device thread


def backward_on_device_thread(monkeypatch: Any) -> None:
    """torch.autograd.backward runs the real backward on a thread named like autograd's
    device thread while the caller blocks, as the engine does for CUDA nodes: gradient
    hooks and final callbacks run there, not on the training thread. Install before the
    agent (which wraps whatever torch.autograd.backward is)."""
    import torch.autograd as autograd

    real = autograd.backward

    def backward(*args: Any, **kwargs: Any) -> Any:
        box: list[Any] = []

        def run() -> None:
            try:
                box.append((True, real(*args, **kwargs)))
            except BaseException as exc:  # noqa: BLE001 - re-raised on the caller
                box.append((False, exc))

        worker = threading.Thread(target=run, name=AUTOGRAD_THREAD)
        worker.start()
        worker.join()
        ok, value = box[0]
        if not ok:
            raise value
        return value

    monkeypatch.setattr(autograd, "backward", backward)


def background_batches(loader: Any, depth: int = 2) -> Iterator[Any]:
    """Batches of `loader` fetched by a prefetch thread (prefetch_generator, MONAI's
    ThreadDataLoader): the DataLoader's __next__ runs there, the training thread waits on
    a queue."""
    import queue

    q: queue.Queue = queue.Queue(maxsize=depth)
    done = object()

    def fill() -> None:
        for batch in loader:
            q.put(batch)
        q.put(done)

    threading.Thread(target=fill, name="prefetch", daemon=True).start()
    while True:
        item = q.get()
        if item is done:
            return
        yield item


def installed_double(monkeypatch: Any) -> Iterator[CudaDouble]:
    """torch.cuda replaced by a 2-device double (pinned memory too) for a test, the
    agent's hooks and capture count reset after it: the body of the CUDA tests' `cuda`
    fixture (`yield from installed_double(monkeypatch)`)."""
    import torch
    import torch._dynamo  # noqa: F401 - optimizers import it on first use, with the real cuda

    from traceml_agent import hooks, recorder

    double = CudaDouble(devices=2)
    monkeypatch.setattr(torch, "cuda", double)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    patch_pinned_memory(monkeypatch, double)
    yield double
    hooks.uninstall()
    recorder._captures = 0
