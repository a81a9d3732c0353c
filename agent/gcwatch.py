"""Garbage-collection pauses of this rank, timed by the interpreter's own callbacks.

A rank that holds many objects (a cache of Python objects, a dataset of dicts) pays a
full collection now and then: tens or hundreds of ms in which the whole process stops,
and every other rank waits for it in its next collective. The stall log sees a periodic
stall in whatever phase was allocating; only the interpreter knows it was the collector.
`gc.callbacks` calls us at each collection's start and stop with its generation, so the
agent counts, from the first step on, the pauses at least SLOW_GC_MS long (those are
what stall a step), their total and the longest, and sends them in the heartbeat;
judge/advice.py compares them with the rank's stalls (docs/diagnosis.md, "Advice from
evidence").

Cost: two perf_counter calls and a few additions per collection (collections happen at
most every few hundred allocations; a young one takes microseconds itself). The callback
never raises (an exception there would print from inside the user's allocation).
"""

from __future__ import annotations

import gc
from time import perf_counter
from typing import Any

# A pause at least this long can stall a step (the stall log's STALL_MIN_MS is 5 ms);
# shorter ones are the young generations' everyday work.
SLOW_GC_MS = 5.0


class GcWatch:
    """Counters of this process's collections (read by the sender thread: plain floats
    and ints, each written whole)."""

    __slots__ = ("collections", "slow", "slow_ms", "max_ms", "full", "_t0", "armed")

    def __init__(self) -> None:
        # Counting starts with training (arm(): at the first optimizer step): a
        # gc.collect() in the set-up is no step's stall, and counted it would pass for
        # the cause of a checkpoint's stalls.
        self.armed = False
        self.collections = 0  # every collection, any generation
        self.full = 0  # generation-2 collections
        self.slow = 0  # pauses of at least SLOW_GC_MS
        self.slow_ms = 0.0  # their total
        self.max_ms = 0.0  # the longest pause
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if not self.armed:
            return
        try:
            if phase == "start":
                self._t0 = perf_counter()
                return
            if not self._t0:
                return  # armed during this collection
            ms = (perf_counter() - self._t0) * 1000.0
            self.collections += 1
            if info.get("generation") == 2:
                self.full += 1
            if ms >= SLOW_GC_MS:
                self.slow += 1
                self.slow_ms += ms
            if ms > self.max_ms:
                self.max_ms = ms
        except Exception:
            pass


_watch: GcWatch | None = None


def install() -> GcWatch:
    """Start counting (a fresh watch, once per agent start); the watch to read."""
    global _watch
    uninstall()
    _watch = GcWatch()
    gc.callbacks.append(_watch)
    return _watch


def arm() -> None:
    """Training has begun: count from now on (the hooks at the first optimizer step, the
    sender at its first heartbeat after a step for loops the hooks do not see)."""
    if _watch is not None:
        _watch.armed = True


def uninstall() -> None:
    """Stop counting. The counters stay readable (current()): the sender's last heartbeat,
    after the agent's teardown, still carries them."""
    if _watch is not None:
        try:
            gc.callbacks.remove(_watch)
        except ValueError:
            pass


def current() -> GcWatch | None:
    return _watch
