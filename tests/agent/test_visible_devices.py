"""CUDA_VISIBLE_DEVICES in every form clusters use, mapped to the right NVML device (an
NVML double stands in for pynvml), and read by one parser only."""

from __future__ import annotations

import pytest

from nvml_double import Board, NvmlDouble, uuid
from traceml_agent import checks
from traceml_agent import visible_devices as vd

UUIDS = [uuid(0xaaaa), uuid(0xbbbb), uuid(0xcccc)]
MIG = uuid(0xdddd, "MIG")


def nvml() -> object:
    """Three boards of one model in PCI order; the last is MIG-enabled with one instance."""
    boards = [Board(UUIDS[0]), Board(UUIDS[1]), Board(UUIDS[2], migs=(MIG,))]
    return NvmlDouble(boards).module()


PARSE = [
    ("unset", None, None),
    ("empty: no devices", "", []),
    ("indices", "2, 0", [("index", "2"), ("index", "0")]),
    ("leading zeros", "01", [("index", "1")]),
    ("uuids", f"{UUIDS[2]},{UUIDS[0]}", [("uuid", UUIDS[2]), ("uuid", UUIDS[0])]),
    ("mig", MIG, [("mig", MIG)]),
    ("stops at a bad entry", "1,x,2", [("index", "1")]),
]


@pytest.mark.parametrize("name, value, expected", PARSE, ids=[p[0] for p in PARSE])
def test_parse(name, value, expected):
    got = vd.parse(value)
    assert (None if got is None else [(d.kind, d.value) for d in got]) == expected


HANDLES = [
    ("unset: torch index is physical", None, 1, ("gpu", 1)),
    ("indices renumbered", "2,0", 0, ("gpu", 2)),
    ("uuid", f"{UUIDS[2]},{UUIDS[1]}", 1, ("gpu", 1)),
    ("uuid prefix", "GPU-0000bbbb", 0, ("gpu", 1)),
    ("mig instance", MIG, 0, ("mig", 2, 0)),
]


@pytest.mark.parametrize("name, value, cuda_index, handle", HANDLES, ids=[h[0] for h in HANDLES])
def test_nvml_handle_for_each_form(name, value, cuda_index, handle):
    target = vd.nvml_target(nvml(), cuda_index, vd.parse(value))
    assert (target.mig or target.gpu) == handle


def test_an_index_outside_the_visible_list_is_refused():
    with pytest.raises(LookupError, match="not in CUDA_VISIBLE_DEVICES"):
        vd.nvml_target(nvml(), 1, vd.parse("0"))


# The same physical GPU named two ways by two ranks must give one device key: the
# setup check that flags ranks sharing a GPU compares these (checks.device_key).
PHYSICAL = [
    ("index", "3,1", 1, "cuda:1"),
    ("leading zero, as CUDA reads it", "01", 0, "cuda:1"),
    ("uuid: as device_key's own form", f"{UUIDS[1]}", 0, UUIDS[1]),
    ("unset", None, 2, "cuda:2"),
]


@pytest.mark.parametrize("name, value, index, key", PHYSICAL, ids=[p[0] for p in PHYSICAL])
def test_device_key_fallback_reads_the_one_parser(name, value, index, key, monkeypatch):
    if value is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    assert checks._physical_cuda(index) == key
