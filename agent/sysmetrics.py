"""System samples for one rank: process CPU % and RSS always, and the shares of time the
training thread ran on a CPU and waited for one where the kernel keeps scheduler
statistics per thread; GPU utilisation, memory and health (power, SM clock, temperature,
clock-throttle reasons) through NVML when the rank drives a CUDA device, and this
process's own figures from torch's caching allocator.

Runs on the agent's sender thread, never on the training thread. Every source is
optional: a missing psutil or NVML only leaves its fields None, and `gpu_note` says why
the GPU fields are empty. NVML is opened by the UUID torch reported for the rank's
device (visible_devices.py); an open that fails is tried again with backoff, and so is a
metric that keeps failing, so a driver that comes up late still gets sampled.

NVML's device memory counts every process on the GPU; users size batches by their own
process's allocator numbers (`memory_allocated`, `memory_reserved`, the peak), so both
are sent. The allocator's counters live in host memory and are read under its own
lock (`torch.cuda.memory_stats_as_nested_dict(index)` with an explicit index): no CUDA
driver call, no context, no sync, so they are safe off the training thread and during
a graph capture.

The memory this rank may still take before the limit (`mem_avail_mb`: the cgroup's
limit less its usage, where the cgroup has one, v2 `memory.max` or v1
`memory.limit_in_bytes`, and never more than the host's MemAvailable) is read here, on
the rank's own host, beside its RSS: the collector may run on another node, and a rank
whose memory grows is killed by its own cgroup or host (judge/memory.py, the time left).
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from . import visible_devices

METRIC_FAILURES = 3  # consecutive errors before a GPU metric is rested (backoff below)
# Seconds before a failed NVML open or a rested metric is tried again: doubling from the
# first to the last, so a driver that comes up late is found within a minute, and a
# metric the device does not support costs one call a minute.
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 60.0
MAX_NOTE = 120  # characters of gpu_note (one line in the rank panel)

# NVML's constants, by value: pynvml's names for them changed across versions.
CLOCK_SM = 1  # NVML_CLOCK_SM
TEMPERATURE_GPU = 0  # NVML_TEMPERATURE_GPU
# nvmlClocksEventReason* (nvmlClocksThrottleReason* before driver 535): bit -> name.
THROTTLE_BITS: tuple[tuple[int, str], ...] = (
    (0x1, "idle"),
    (0x2, "app clocks"),
    (0x4, "power cap"),
    (0x8, "hw slowdown"),
    (0x10, "sync boost"),
    (0x20, "sw thermal"),
    (0x40, "hw thermal"),
    (0x80, "power brake"),
    (0x100, "display clocks"),
)

GPU_FIELDS = ("gpu_util", "gpu_mem_mb", "gpu_mem_total_mb", "power_w", "sm_clock_mhz",
              "sm_clock_max_mhz", "temp_c", "throttle", "gpu_uuid", "gpu_note")


def throttle_names(mask: int) -> tuple[str, ...]:
    return tuple(name for bit, name in THROTTLE_BITS if mask & bit)


def _why(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    name = type(exc).__name__
    if isinstance(exc, LookupError) and text:  # our own words (visible_devices.py)
        return text
    if isinstance(exc, ImportError):
        return "pynvml is not installed (pip install nvidia-ml-py)"
    return f"{name}: {text}" if text and text != name else name


class _Backoff:
    """When to try something that failed again: RETRY_FIRST_S, doubling to RETRY_MAX_S."""

    __slots__ = ("delay", "at")

    def __init__(self) -> None:
        self.delay = 0.0
        self.at = 0.0

    def failed(self, now: float) -> None:
        self.delay = RETRY_FIRST_S if not self.delay else min(RETRY_MAX_S, 2 * self.delay)
        self.at = now + self.delay

    def due(self, now: float) -> bool:
        return now >= self.at


def _cpu_seconds() -> float:
    """CPU time of this process (every thread), user and system, to the nanosecond.
    os.times() counts in scheduler ticks (10 ms): over a short interval one tick read as
    thousands of percent (4,437 % on 2 cores between two samples 0.2 ms apart)."""
    return time.process_time()


_CPUS = os.cpu_count() or 1


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss_bytes() -> int | None:
    """Resident memory of this process from /proc/self/statm; None without procfs."""
    try:
        fd = os.open("/proc/self/statm", os.O_RDONLY)
    except OSError:
        return None
    try:
        return int(os.read(fd, 256).split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None
    finally:
        os.close(fd)


def _schedstat(tid: int) -> tuple[int, int, int] | None:
    """Nanoseconds thread `tid` of this process ran on a CPU and spent runnable but
    waiting for one (the run queue), and its timeslices, from the scheduler's statistics:
    /proc/self/task/TID/schedstat is "on-CPU ns, run-queue ns, timeslices". None where
    the kernel has none."""
    try:
        fd = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
    except OSError:
        return None
    try:
        fields = os.read(fd, 128).split()
        return int(fields[0]), int(fields[1]), int(fields[2])
    except (OSError, ValueError, IndexError):
        return None
    finally:
        os.close(fd)


# A cgroup v1 "no limit" is a page-rounded 2**63 - 1; anything from 2**60 bytes is none.
NO_LIMIT_BYTES = 2**60


def _read_int(path: str) -> int | None:
    """The first number in a small /proc or /sys file; None when unreadable or 'max'."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return int(os.read(fd, 64).split()[0])
    except (OSError, ValueError, IndexError):
        return None
    finally:
        os.close(fd)


def _cgroup_files(root: str = "/") -> tuple[str, str] | None:
    """(limit file, usage file) of this process's memory cgroup: v2 `memory.max` and
    `memory.current`, else v1's; the path /proc/self/cgroup names under the mount, or the
    mount's root (a container's cgroup namespace shows its own cgroup there). None
    without a memory cgroup. `root`: "/" but in tests."""
    v2 = v1 = None
    try:
        with open(os.path.join(root, "proc/self/cgroup")) as f:
            for line in f.read(4096).splitlines():
                parts = line.split(":", 2)
                if len(parts) != 3:
                    continue
                if parts[0] == "0" and parts[1] == "":
                    v2 = parts[2]
                elif "memory" in parts[1].split(","):
                    v1 = parts[2]
    except OSError:
        return None
    candidates = []
    if v1 is not None:
        for path in (v1, "/"):
            base = os.path.join(root, "sys/fs/cgroup/memory") + path.rstrip("/")
            candidates.append((base + "/memory.limit_in_bytes", base + "/memory.usage_in_bytes"))
    if v2 is not None:
        for path in (v2, "/"):
            base = os.path.join(root, "sys/fs/cgroup") + path.rstrip("/")
            candidates.append((base + "/memory.max", base + "/memory.current"))
    return next((c for c in candidates if os.path.exists(c[1])), None)


def _host_available_bytes(root: str = "/") -> int | None:
    """MemAvailable from /proc/meminfo (the kernel's estimate of what can still be
    allocated without swapping); None without procfs."""
    try:
        fd = os.open(os.path.join(root, "proc/meminfo"), os.O_RDONLY)
    except OSError:
        return None
    try:
        for line in os.read(fd, 4096).split(b"\n"):
            if line.startswith(b"MemAvailable:"):
                return int(line.split()[1]) * 1024
        return None
    except (OSError, ValueError, IndexError):
        return None
    finally:
        os.close(fd)


class MemoryHeadroom:
    """Bytes this process may still take before its limit: its cgroup's limit less the
    cgroup's usage where a limit is set, the host's available memory otherwise, the
    smaller of the two when both apply. Files found once, read each sample (two or three
    small reads, on the sender thread)."""

    __slots__ = ("_files", "_root")

    def __init__(self, root: str = "/") -> None:
        self._root = root
        self._files: tuple[str, str] | None | bool = False  # False: not looked for yet

    def bytes(self) -> int | None:
        if self._files is False:
            self._files = _cgroup_files(self._root)
        host = _host_available_bytes(self._root)
        if isinstance(self._files, tuple):
            limit = _read_int(self._files[0])  # "max" (v2, no limit) reads as None
            usage = _read_int(self._files[1])
            if limit is not None and limit < NO_LIMIT_BYTES and usage is not None:
                room = max(0, limit - usage)
                return room if host is None else min(room, host)
        return host


# Shares over less wall time than this are a few scheduler ticks (up to ~10 ms each:
# fresh-clone run 35 read 21 % of a ~5 ms spin), not a share: the sample in the very wake
# that first marked the thread covered microseconds, and read 0 % on a CPU and waiting.
MIN_SHARE_S = 0.1


class ThreadSchedule:
    """The shares of wall time the training thread ran on a CPU and waited for one,
    between two samples.

    A rank whose cores are oversubscribed (other processes, too many DataLoader workers
    or intra-op threads) is slow because its thread waits its turn, not because it has
    more work: these are the evidence that tells the two apart (judge/evidence.cpu_wait,
    which compares the share of its ready time a thread waited, so that a thread with
    more work on an evenly busy host is not taken for a starved one). Only the training
    thread (the one that opens forward, backward and optimizer) is read: it is the
    step's critical path on the host."""

    __slots__ = ("_ident", "_tid", "_mark", "_stepped", "span_s")

    def __init__(self) -> None:
        self._ident: int | None = None  # the Python thread (threading.get_ident)
        self._tid: int | None = None  # its kernel id
        self._mark: tuple[int, int, float] | None = None
        # The thread's times when it was last seen stepping (`stepped`): where the exit's
        # interval ends, so that a teardown of seconds is not read as the training's.
        self._stepped: tuple[int, int, float] | None = None
        self.span_s = 0.0  # the wall time of the last interval read (shares, to_last_step)

    def prime(self, ident: int | None, now: float) -> None:
        """The first mark for thread `ident` as soon as it is known, not at the next
        sample: a job that trains a second or two still gets one interval read (the
        exit's, `to_last_step`), or none would tell its starved rank from a slow one. A
        mark already taken for it is kept."""
        if ident is not None and (ident != self._ident or self._mark is None):
            self.shares(ident, now)

    def stepped(self, ident: int | None, now: float) -> None:
        """Thread `ident` was seen to step just now: its times are kept (not a mark)."""
        if ident is not None and ident == self._ident and self._mark is not None:
            self._stepped = self._read(now)

    def shares(self, ident: int | None, now: float) -> tuple[float, float] | None:
        """(ran, waited) of thread `ident` since the last call; None: the first call, a
        thread that cannot be read, a kernel that keeps no CPU time for it, or an
        interval shorter than MIN_SHARE_S (a sample in the wake that primed the mark)."""
        if ident != self._ident:
            self._ident, self._mark = ident, None
            self._tid = next((t.native_id for t in threading.enumerate()
                              if t.ident == ident), None) if ident is not None else None
        mark, self._mark, self._stepped = self._mark, self._read(now), None
        shares = self._span(mark, self._mark)
        return shares if self.span_s >= MIN_SHARE_S else None

    def to_last_step(self, min_s: float = 0.0) -> tuple[float, float] | None:
        """(ran, waited) from the last mark to when the thread was last seen stepping;
        None unless it stepped at least `min_s` after the mark."""
        mark, end = self._mark, self._stepped
        if mark is None or end is None or end[2] - mark[2] < min_s:
            return None
        return self._span(mark, end)

    def _span(self, mark: tuple[int, int, float] | None, end: tuple[int, int, float] | None
              ) -> tuple[float, float] | None:
        """_between, keeping the interval's length for the stepping share it is sent with."""
        shares = _between(mark, end)
        self.span_s = end[2] - mark[2] if shares is not None and mark and end else 0.0
        return shares

    def _read(self, now: float) -> tuple[int, int, float] | None:
        if self._tid is None:
            return None
        times = _schedstat(self._tid)
        if times is None:  # no schedstat here, or the thread ended
            self._tid = None
            return None
        ran, waited, slices = times
        if ran == 0 and waited == 0 and slices == 0:  # a kernel that keeps no times per thread
            return None
        # "0 0 1" is a thread that just started and has not been charged a tick yet (3 of
        # 200 fresh threads on this VM): a true zero, a valid mark.
        return ran, waited, now


def _between(mark: tuple[int, int, float] | None, end: tuple[int, int, float] | None
             ) -> tuple[float, float] | None:
    """The shares of the wall time from `mark` to `end` a thread ran and waited."""
    if mark is None or end is None or end[2] <= mark[2]:
        return None
    span = (end[2] - mark[2]) * 1e9
    return (min(1.0, max(0.0, (end[0] - mark[0]) / span)),
            min(1.0, max(0.0, (end[1] - mark[1]) / span)))


class SystemSampler:
    def __init__(self, cuda_index: int | None = None, uuid: str | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.cuda_index: int | None = None
        self.uuid: str | None = None
        self._clock = clock or time.monotonic
        self._proc = None
        self._nvml: Any = None
        self._target: visible_devices.NvmlTarget | None = None
        self._open_retry = _Backoff()
        self._open_error: str | None = None
        self._failures: dict[str, int] = {}
        self._rested: dict[str, _Backoff] = {}
        self._errors: dict[str, str] = {}
        self._max_clock: float | None = None
        self._old_driver = False  # the driver lacks ...ClocksEventReasons (before 535)
        self._sampled_uuid: str | None = None
        # CPU % and RSS from os.times() and /proc/self/statm where there is one (three
        # system calls, ~10x cheaper than psutil's Process, which parses /proc/PID/stat
        # in Python); psutil elsewhere.
        self._cpu_mark = (_cpu_seconds(), time.monotonic())
        self._schedule = ThreadSchedule()
        self._headroom = MemoryHeadroom()
        if _rss_bytes() is None:
            try:
                import psutil

                self._proc = psutil.Process(os.getpid())
                self._proc.cpu_percent(None)  # the first call only primes the counter
            except Exception:
                self._proc = None
        if cuda_index is not None:
            self.open_gpu(cuda_index, uuid)

    def open_gpu(self, cuda_index: int, uuid: str | None = None) -> None:
        """Sample torch's device `cuda_index` (whose UUID torch reported as `uuid`) from
        now on, through NVML, never CUDA: this runs on the sender thread."""
        self.close()
        self.cuda_index, self.uuid = cuda_index, uuid
        self._open_retry = _Backoff()
        self._try_open()

    def _try_open(self) -> None:
        assert self.cuda_index is not None
        nvml = None
        try:
            import pynvml

            pynvml.nvmlInit()
            nvml = pynvml
            self._target = visible_devices.nvml_target(
                pynvml, self.cuda_index, visible_devices.from_env(), self.uuid,
                visible_devices.order_from_env())
            self._nvml, self._open_error = pynvml, None
            self._sampled_uuid = self._uuid_of(self._target)
        except Exception as exc:
            if nvml is not None:
                try:
                    nvml.nvmlShutdown()
                except Exception:
                    pass
            self._nvml = self._target = None
            self._open_error = _why(exc)
            self._open_retry.failed(self._clock())

    def _uuid_of(self, target: visible_devices.NvmlTarget) -> str | None:
        try:
            text = self._nvml.nvmlDeviceGetUUID(target.mig or target.gpu)
            return (text.decode() if isinstance(text, bytes) else str(text))[:64]
        except Exception:
            return None

    # --- sampling -------------------------------------------------------------------

    def prime(self, training_thread: int | None, stepped: bool = False) -> None:
        """ThreadSchedule.prime: one read of /proc the first time a thread is known; and
        where the rank `stepped` since the last call, its times then (ThreadSchedule.
        stepped: a read of /proc at most every wake of the sender while it trains)."""
        try:
            now = time.monotonic()
            self._schedule.prime(training_thread, now)
            if stepped:
                self._schedule.stepped(training_thread, now)
        except Exception:  # whatever this platform lacks, the samples still go
            pass

    def exit_sample(self, min_s: float, stepped_s: float | None = None) -> dict[str, Any] | None:
        """At the process's end, the training thread's shares from the last sample to its
        last step, marked `at_exit`: the collector takes nothing else from it (memory at
        exit is the teardown's, not the training's). None without such an interval of at
        least `min_s`. `stepped_s`: the steps' wall time in it (stepping_pct)."""
        try:
            shares = self._schedule.to_last_step(min_s)
        except Exception:
            shares = None
        if shares is None:
            return None
        return {"thread_cpu_pct": round(shares[0] * 100, 1),
                "cpu_wait_pct": round(shares[1] * 100, 1), "at_exit": True,
                "stepping_pct": self._stepping_pct(stepped_s)}

    def _stepping_pct(self, stepped_s: float | None) -> float | None:
        """The share of the shares' interval the rank spent in steps, in percent (a step
        taken off the queue a wake late can push it past 100: capped)."""
        span = self._schedule.span_s
        if stepped_s is None or span <= 0.0:
            return None
        return round(min(100.0, max(0.0, 100.0 * stepped_s / span)), 1)

    def sample(self, training_thread: int | None = None, stepped: bool = True,
               stepped_s: float | None = None) -> dict[str, Any]:
        """One sample; `training_thread` (threading.get_ident of the thread that trains,
        None: not known yet) for the shares of time it ran on a CPU and waited for one,
        sent only when it `stepped` since the last sample: a thread blocked in a
        collective, or done, waits for no core, and its start-up is not its steps.
        `stepped_s`: the wall time of the steps taken since the last sample, sent as the
        share of the interval they fill (stepping_pct): shares of an interval mostly
        spent elsewhere (start-up, evaluation, a checkpoint) say little of the steps."""
        out: dict[str, Any] = {
            "cpu_pct": None,
            "thread_cpu_pct": None,
            "cpu_wait_pct": None,
            "stepping_pct": None,
            "rss_mb": None,
            **dict.fromkeys(GPU_FIELDS),
            "gpu_alloc_mb": None,
            "gpu_reserved_mb": None,
            "gpu_peak_mb": None,
            "device": None if self.cuda_index is None else f"cuda:{self.cuda_index}",
            "mem_avail_mb": None,
        }
        rss = _rss_bytes()
        if rss is not None:
            cpu, t = _cpu_seconds(), time.monotonic()
            cpu0, t0 = self._cpu_mark
            self._cpu_mark = (cpu, t)
            # As psutil's cpu_percent(None): percent of one CPU since the last sample.
            # Never more than every CPU busy: clocks read a few ns apart can overshoot.
            pct = (cpu - cpu0) / (t - t0) * 100 if t > t0 else 0.0
            out["cpu_pct"] = round(min(max(pct, 0.0), 100.0 * _CPUS), 1)
            out["rss_mb"] = rss / 2**20
        elif self._proc is not None:
            try:
                out["cpu_pct"] = float(self._proc.cpu_percent(None))
                out["rss_mb"] = self._proc.memory_info().rss / 2**20
            except Exception:
                self._proc = None
        try:
            room = self._headroom.bytes()
            out["mem_avail_mb"] = None if room is None else room / 2**20
        except Exception:  # whatever this platform lacks, the other figures still go
            pass
        try:
            shares = self._schedule.shares(training_thread, time.monotonic())
        except Exception:  # whatever this platform lacks, the other figures still go
            shares = None
        if shares is not None and stepped:
            out["thread_cpu_pct"] = round(shares[0] * 100, 1)
            out["cpu_wait_pct"] = round(shares[1] * 100, 1)
            out["stepping_pct"] = self._stepping_pct(stepped_s)
        now = self._clock()
        if self.cuda_index is not None and self._nvml is None and self._open_retry.due(now):
            self._try_open()
        if self._nvml is not None:
            self._sample_nvml(out, now)
        if self.cuda_index is not None:
            self._metric(out, now, "alloc", lambda: self._allocator(out, self.cuda_index))
        out["gpu_note"] = self._note()
        return out

    def _sample_nvml(self, out: dict[str, Any], now: float) -> None:
        """Each metric on its own: utilisation is "not supported" on a MIG instance, and
        power on some boards, which must not take the other figures with them."""
        nvml, target = self._nvml, self._target
        assert target is not None
        out["gpu_uuid"] = self._sampled_uuid
        gpu = target.gpu

        def util() -> None:
            if target.mig is not None:  # the GPU's figure would be every instance's
                raise LookupError("not reported for a MIG instance")
            out["gpu_util"] = float(nvml.nvmlDeviceGetUtilizationRates(gpu).gpu)

        def mem() -> None:
            if not target.memory_ok:
                raise LookupError("MIG instance not identified; the GPU's is every one's")
            info = nvml.nvmlDeviceGetMemoryInfo(target.mig or gpu)
            out["gpu_mem_mb"] = info.used / 2**20
            out["gpu_mem_total_mb"] = info.total / 2**20

        def power() -> None:
            out["power_w"] = nvml.nvmlDeviceGetPowerUsage(gpu) / 1000.0

        def clock() -> None:
            out["sm_clock_mhz"] = float(nvml.nvmlDeviceGetClockInfo(gpu, CLOCK_SM))
            if self._max_clock is None:  # a property of the board: read once
                self._max_clock = float(nvml.nvmlDeviceGetMaxClockInfo(gpu, CLOCK_SM))
            out["sm_clock_max_mhz"] = self._max_clock

        def temp() -> None:
            out["temp_c"] = float(nvml.nvmlDeviceGetTemperature(gpu, TEMPERATURE_GPU))

        def throttle() -> None:
            out["throttle"] = throttle_names(int(self._throttle_reasons(gpu)))

        for name, read in (("util", util), ("mem", mem), ("power", power), ("clock", clock),
                           ("temp", temp), ("throttle", throttle)):
            self._metric(out, now, name, read)

    def _throttle_reasons(self, gpu: Any) -> int:
        """NVML's clock-event (throttle) reason bits. A binding may know the 535+ name
        (nvmlDeviceGetCurrentClocksEventReasons) while the driver is older and lacks the
        function (NVMLError_FunctionNotFound): then the older name, which every driver
        exports, from that sample on."""
        nvml = self._nvml
        new = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        old = getattr(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
        if new is not None and (not self._old_driver or old is None):
            try:
                return int(new(gpu))
            except Exception:
                if old is None:
                    raise
                self._old_driver = True
        if old is None:
            raise LookupError("this pynvml has no clock-event reasons call")
        return int(old(gpu))

    def _metric(self, out: dict[str, Any], now: float, name: str,
                read: Callable[[], None]) -> None:
        """Read one metric unless it is resting; METRIC_FAILURES errors in a row rest it,
        with backoff, and keep the error for the note."""
        rest = self._rested.get(name)
        if rest is not None and not rest.due(now):
            return
        try:
            read()
        except Exception as exc:
            self._errors[name] = _why(exc)
            self._failures[name] = self._failures.get(name, 0) + 1
            if self._failures[name] >= METRIC_FAILURES or rest is not None:
                self._rested.setdefault(name, _Backoff()).failed(now)
            return
        self._failures.pop(name, None)
        self._rested.pop(name, None)
        self._errors.pop(name, None)

    @staticmethod
    def _allocator(out: dict[str, Any], index: int | None) -> None:
        """This process's allocator figures for torch device `index` (see above)."""
        cuda = sys.modules["torch"].cuda  # torch is loaded once a device is learned
        stats = cuda.memory_stats_as_nested_dict(index)
        if not stats:  # torch says CUDA is not initialised (e.g. in a forked child)
            return
        allocated, reserved = stats["allocated_bytes"]["all"], stats["reserved_bytes"]["all"]
        out["gpu_alloc_mb"] = allocated["current"] / 2**20
        out["gpu_reserved_mb"] = reserved["current"] / 2**20
        out["gpu_peak_mb"] = allocated["peak"] / 2**20

    def _note(self) -> str | None:
        """Why GPU figures are missing, in one line; None when nothing is."""
        if self.cuda_index is None:
            return None
        if self._nvml is None:
            wait = math.ceil(max(0.0, self._open_retry.at - self._clock()))
            return f"NVML not open: {self._open_error} (retry in {wait} s)"[:MAX_NOTE]
        failing = [f"{name}: {self._errors[name]}" for name in sorted(self._rested)
                   if name in self._errors]
        return "; ".join(failing)[:MAX_NOTE] or None

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._nvml = None
        self._target = None
        self._failures.clear()
        self._rested.clear()
        self._errors.clear()
        self._max_clock = None
        self._sampled_uuid = None
