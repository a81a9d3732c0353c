"""A stand-in for pynvml (put in sys.modules) with the behaviours that map a rank to the
wrong GPU when ignored: boards listed in PCI order (NVML's) whatever CUDA's order is, MIG
instances under a MIG-enabled GPU, an nvmlInit that fails a few times before the driver
answers, metrics a board does not support, and clock-throttle reasons as NVML's bits;
boards a cgroup device constraint denies (Slurm's ConstrainDevices: counted, but any call
naming them raises NO_PERMISSION), and a driver older than the binding (the 535+ name
present, the function missing: FUNCTION_NOT_FOUND).

Handles are tuples: ("gpu", i) for the board at PCI position i, ("mig", i, j) for MIG
slot j of board i. Every call is logged in `calls` (name, first argument)."""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):  # noqa: N801 - pynvml's name
    def __str__(self) -> str:
        return "Not Supported"


class NVMLError_NotFound(NVMLError):  # noqa: N801
    def __str__(self) -> str:
        return "Not Found"


class NVMLError_DriverNotLoaded(NVMLError):  # noqa: N801
    def __str__(self) -> str:
        return "Driver Not Loaded"


class NVMLError_NoPermission(NVMLError):  # noqa: N801
    def __str__(self) -> str:
        return "Insufficient Permissions"


class NVMLError_FunctionNotFound(NVMLError):  # noqa: N801
    def __str__(self) -> str:
        return "Function Not Found"


def uuid(n: int, kind: str = "GPU") -> str:
    """A UUID as NVML writes it; `bare(uuid(n))` is what torch reports."""
    return f"{kind}-{n:08x}-1111-2222-3333-444455556666"


def bare(text: str) -> str:
    return text.split("-", 1)[1]


@dataclass
class Board:
    """One physical GPU. `migs`: the UUIDs of its MIG instances (MIG mode on when any)."""

    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    util: float = 50.0
    used_gb: float = 10.0
    sm_clock: float = 1980.0
    sm_clock_max: float = 1980.0
    power_mw: int = 300_000
    temp_c: float = 60.0
    reasons: int = 0
    migs: tuple[str, ...] = ()
    mig_used_gb: float = 3.0


@dataclass
class NvmlDouble:
    boards: list[Board]
    init_failures: int = 0  # nvmlInit raises this many times, then succeeds
    mig_lookup: bool = True  # nvmlDeviceGetHandleByUUID knows MIG UUIDs (R470 and later)
    event_api: bool = True  # driver 535+ names: ...ClocksEventReasons
    failing: set[str] = field(default_factory=set)  # metrics that raise NotSupported
    denied: set[int] = field(default_factory=set)  # PCI positions off-limits (cgroup)
    driver_events: bool = True  # the driver has ...ClocksEventReasons (535+)
    calls: list[tuple[str, Any]] = field(default_factory=list)

    def module(self) -> types.ModuleType:
        m = types.ModuleType("pynvml")
        m.NVMLError = NVMLError  # type: ignore[attr-defined]
        for name in dir(self):
            if name.startswith("nvml"):
                setattr(m, name, self._logged(name, getattr(self, name)))
        if not self.event_api:
            del m.nvmlDeviceGetCurrentClocksEventReasons
        elif self.driver_events:
            del m.nvmlDeviceGetCurrentClocksThrottleReasons
        # else: a new binding on an old driver has both names; the new one fails
        return m

    def _logged(self, name: str, fn: Any) -> Any:
        def call(*args: Any) -> Any:
            self.calls.append((name, args[0] if args else None))
            return fn(*args)
        return call

    def count(self, name: str) -> int:
        return sum(1 for c, _ in self.calls if c == name)

    # --- pynvml's API ------------------------------------------------------------------

    def nvmlInit(self) -> None:  # noqa: N802
        if self.init_failures > 0:
            self.init_failures -= 1
            raise NVMLError_DriverNotLoaded()

    def nvmlShutdown(self) -> None:  # noqa: N802
        pass

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return len(self.boards)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> tuple:  # noqa: N802
        if not 0 <= i < len(self.boards):
            raise NVMLError("Invalid Argument")
        if i in self.denied:
            raise NVMLError_NoPermission()
        return ("gpu", i)

    def nvmlDeviceGetHandleByUUID(self, text: str) -> tuple:  # noqa: N802
        for i, b in enumerate(self.boards):
            if i in self.denied and (b.uuid == text or text in b.migs):
                raise NVMLError_NoPermission()
            if b.uuid == text:
                return ("gpu", i)
            if self.mig_lookup and text in b.migs:
                return ("mig", i, b.migs.index(text))
        raise NVMLError_NotFound()

    def nvmlDeviceGetUUID(self, h: tuple) -> bytes:  # noqa: N802
        b = self.boards[h[1]]
        return (b.migs[h[2]] if h[0] == "mig" else b.uuid).encode()

    def nvmlDeviceGetName(self, h: tuple) -> bytes:  # noqa: N802
        return self.boards[h[1]].name.encode()

    def nvmlDeviceGetMigMode(self, h: tuple) -> tuple[int, int]:  # noqa: N802
        if h[0] == "mig":
            raise NVMLError_NotSupported()
        on = int(bool(self.boards[h[1]].migs))
        return (on, on)

    def nvmlDeviceGetMaxMigDeviceCount(self, h: tuple) -> int:  # noqa: N802
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: tuple, j: int) -> tuple:  # noqa: N802
        if j >= len(self.boards[h[1]].migs):
            raise NVMLError_NotFound()
        return ("mig", h[1], j)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, h: tuple) -> tuple:  # noqa: N802
        return ("gpu", h[1])

    def _board(self, h: tuple, metric: str, mig_ok: bool = False) -> Board:
        if metric in self.failing or (h[0] == "mig" and not mig_ok):
            raise NVMLError_NotSupported()
        return self.boards[h[1]]

    def nvmlDeviceGetUtilizationRates(self, h: tuple) -> Any:  # noqa: N802
        return types.SimpleNamespace(gpu=self._board(h, "util").util, memory=0)

    def nvmlDeviceGetMemoryInfo(self, h: tuple) -> Any:  # noqa: N802
        b = self._board(h, "mem", mig_ok=True)
        gb = b.mig_used_gb if h[0] == "mig" else b.used_gb
        return types.SimpleNamespace(used=int(gb * 2**30), total=80 * 2**30, free=0)

    def nvmlDeviceGetPowerUsage(self, h: tuple) -> int:  # noqa: N802
        return self._board(h, "power").power_mw

    def nvmlDeviceGetClockInfo(self, h: tuple, kind: int) -> int:  # noqa: N802
        assert kind == 1  # NVML_CLOCK_SM
        return int(self._board(h, "clock").sm_clock)

    def nvmlDeviceGetMaxClockInfo(self, h: tuple, kind: int) -> int:  # noqa: N802
        assert kind == 1
        return int(self._board(h, "clock").sm_clock_max)

    def nvmlDeviceGetTemperature(self, h: tuple, sensor: int) -> int:  # noqa: N802
        assert sensor == 0  # NVML_TEMPERATURE_GPU
        return int(self._board(h, "temp").temp_c)

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: tuple) -> int:  # noqa: N802
        if not self.driver_events:
            raise NVMLError_FunctionNotFound()
        return self._board(h, "throttle").reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: tuple) -> int:  # noqa: N802
        return self._board(h, "throttle").reasons
