"""What the in-process benchmarks of the collector's periodic work share
(collector_ticks.py, evaluate_parts.py): a state of canned ranks and the CPU time of a
call, median of 5."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from traceml_tui.collect.canned import make_state
from traceml_tui.judge.state import RunState

NOW = 1_700_000_100.0
MONO_NOW = 0.5  # the canned ranks were last heard at 0.0: stepping, nothing stalled


def canned_state(ranks: int, steps: int) -> RunState:
    """--steps steps of every rank, 8 to a node, a straggler a third of the way in:
    synthetic records through the real protocol and RunState (collect/canned.py)."""
    return make_state(world_size=ranks, nproc_per_node=8, steps=steps, straggler=ranks // 3)


def cpu_ms(fn: Callable[[], object], setup: Callable[[], object] = lambda: None) -> float:
    """CPU milliseconds of `fn`, median of 5 calls; `setup` runs before each, not timed."""
    times = []
    for _ in range(5):
        setup()
        t0 = time.process_time()
        fn()
        times.append((time.process_time() - t0) * 1000)
    return round(statistics.median(times), 1)
