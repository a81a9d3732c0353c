"""CUDA_VISIBLE_DEVICES in every form clusters use, mapped to the right NVML device, and
GPU metrics that fail one at a time (an NVML double stands in for pynvml)."""

from __future__ import annotations

import sys
import types

import pytest

from traceml_agent import visible_devices as vd
from traceml_agent.sysmetrics import SystemSampler

UUIDS = ["GPU-aaaa1111-0000-0000-0000-000000000000", "GPU-bbbb2222-0000-0000-0000-000000000000",
         "GPU-cccc3333-0000-0000-0000-000000000000"]
MIG = "MIG-dddd4444-0000-0000-0000-000000000000"


class NotSupported(Exception):
    pass


def nvml_double(util_supported: bool = True) -> types.ModuleType:
    """Physical GPUs 0-2 by index and UUID, and one MIG instance (no utilisation)."""
    m = types.ModuleType("pynvml")
    m.nvmlInit = lambda: None
    m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetCount = lambda: 3
    m.nvmlDeviceGetHandleByIndex = lambda i: f"gpu{i}"

    def by_uuid(uuid: str) -> str:
        if uuid == MIG:
            return "mig0"
        if uuid in UUIDS:
            return f"gpu{UUIDS.index(uuid)}"
        raise NotSupported("not found")

    m.nvmlDeviceGetHandleByUUID = by_uuid
    m.nvmlDeviceGetUUID = lambda h: UUIDS[int(h[3:])].encode()

    def util(h: str):
        if h == "mig0" or not util_supported:
            raise NotSupported("utilisation not supported")
        return types.SimpleNamespace(gpu=10.0 * (int(h[3:]) + 1))

    m.nvmlDeviceGetUtilizationRates = util
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
        used=(7 if h == "mig0" else int(h[3:]) + 1) * 2**30, total=80 * 2**30)
    return m


PARSE = [
    ("unset", None, None),
    ("empty: no devices", "", []),
    ("indices", "2, 0", [("index", "2"), ("index", "0")]),
    ("uuids", f"{UUIDS[2]},{UUIDS[0]}", [("uuid", UUIDS[2]), ("uuid", UUIDS[0])]),
    ("mig", MIG, [("mig", MIG)]),
    ("stops at a bad entry", "1,x,2", [("index", "1")]),
]


@pytest.mark.parametrize("name, value, expected", PARSE, ids=[p[0] for p in PARSE])
def test_parse(name, value, expected):
    got = vd.parse(value)
    assert (None if got is None else [(d.kind, d.value) for d in got]) == expected


HANDLES = [
    ("unset: torch index is physical", None, 1, "gpu1"),
    ("indices renumbered", "2,0", 0, "gpu2"),
    ("uuid", f"{UUIDS[2]},{UUIDS[1]}", 1, "gpu1"),
    ("uuid prefix", "GPU-cccc", 0, "gpu2"),
    ("mig instance", MIG, 0, "mig0"),
]


@pytest.mark.parametrize("name, value, cuda_index, handle", HANDLES, ids=[h[0] for h in HANDLES])
def test_nvml_handle_for_each_form(name, value, cuda_index, handle):
    assert vd.nvml_handle(nvml_double(), cuda_index, vd.parse(value)) == handle


def test_samples_the_ranks_own_gpu_by_uuid(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", nvml_double())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{UUIDS[2]},{UUIDS[0]}")
    sample = SystemSampler(0).sample()
    assert sample["gpu_util"] == 30.0 and sample["gpu_mem_mb"] == 3 * 1024  # physical GPU 2


def test_memory_is_kept_when_utilisation_is_not_supported(monkeypatch):
    """A MIG instance reports no utilisation: memory goes on being sampled, every time."""
    monkeypatch.setitem(sys.modules, "pynvml", nvml_double())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", MIG)
    sampler = SystemSampler(0)
    for _ in range(5):
        sample = sampler.sample()
        assert sample["gpu_util"] is None
        assert sample["gpu_mem_mb"] == 7 * 1024
