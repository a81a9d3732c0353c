"""(And last, the collector's heap: its large temporaries given back when freed.)

The live evaluation's cadence follows the agents' send interval (collector.eval_interval_s):
a rank's window changes once per batch, so a wide job is judged once per batch interval,
not twice, while a job of up to ~2,500 ranks keeps the 0.5 s cadence (and its latency)."""

from __future__ import annotations

import time

import pytest

from traceml_agent.transport import send_interval_s
from traceml_tui.collect import collector
from traceml_tui.judge.state import RunState


@pytest.mark.parametrize("world, expected", [
    (1, 0.5), (8, 0.5), (1024, 0.5), (2048, 0.5),  # agents send every 0.1-0.4 s
    (4096, 0.8), (5120, 1.0), (16_384, 1.0), (1 << 20, 1.0),  # ... every 0.8 s, then 1 s
])
def test_evaluations_are_spaced_by_the_agents_send_interval(world, expected):
    assert collector.eval_interval_s(world) == pytest.approx(expected)
    assert collector.eval_interval_s(world) >= send_interval_s(world)


def test_a_collector_of_a_wide_job_evaluates_once_a_batch_interval(tmp_path):
    for world, expected in ((4, 0.5), (16_384, 1.0)):
        state = RunState("cadence", world, max(1, world // 8), min(world, 8),
                         started_at=time.time())
        coll = collector.Collector(tmp_path / str(world), state)
        try:
            assert coll.eval_interval_s == pytest.approx(expected)
        finally:
            coll.close()


MALLOC_PROBE = """
import ctypes, sys
import numpy as np
from traceml_tui.collect import collector

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "collector":
    assert collector.fix_mmap_threshold()
big = np.ones(2 << 20)  # 16 MiB, freed: glibc's dynamic threshold rises to it
del big
before = libc.mallinfo2().hblkhd
one = np.ones(1 << 20)  # 8 MiB, as a snapshot's largest temporaries at 16,384 ranks
print((libc.mallinfo2().hblkhd - before) >> 20)
"""


def test_the_collectors_large_temporaries_are_mapped_whatever_was_freed_before():
    """A long run's RSS stays flat only if the collector's multi-MiB temporaries are given
    back when freed: glibc's own threshold rises past them once a larger block is freed,
    and they come from the heap; the collector fixes it (collector.fix_mmap_threshold)."""
    import platform
    import subprocess
    import sys

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc's mallopt and mallinfo2: a Linux glibc host")
    mapped = {how: int(subprocess.run([sys.executable, "-c", MALLOC_PROBE, how],
                                      capture_output=True, text=True, check=True).stdout)
              for how in ("python", "collector")}
    assert mapped == {"python": 0, "collector": 8}, mapped
