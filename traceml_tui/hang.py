"""Hang detection: pure rules over each rank's reported progress. No I/O, no clocks.

A job hangs when no rank has finished a step for longer than a threshold derived
from its recent step times. Then the ranks' progress tells the three cases apart,
the way a user would compare NCCL opCounts across rank logs, but live:

  behind           some ranks made less progress (fewer steps, fewer collectives
                   launched, or an earlier phase of the same step): the others are
                   waiting for them. A conditional collective, or a rank stuck in its
                   own code (data loading, a deadlock, an infinite loop).
  same collective  every rank is at the same point: all stuck in one collective
                   together, which points at the fabric, NCCL, or a shape mismatch.
  dead             a rank stopped sending anything, heartbeats included (they come
                   from a thread that does not need training): its process is gone
                   or frozen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .diagnosis import CRITICAL, HANG, Diagnosis

# No rank finished a step for at least this long: a floor that keeps a checkpoint or an
# evaluation pass of a few seconds from reading as a hang ...
HANG_FLOOR_S = 10.0
# ... and for at least this many median step times, so a job with 2 s steps gets 40 s.
HANG_STEPS = 20
# Heartbeats come every second: this much silence means the process is gone or frozen.
DEAD_SILENCE_S = 5.0

PHASE_ORDER = {None: 0, "dataloader": 1, "h2d": 2, "forward": 3, "backward": 4, "sync": 5,
               "optimizer": 6}

BEHIND, SAME_COLLECTIVE, DEAD = "behind", "same collective", "dead"


@dataclass(frozen=True, slots=True)
class RankProgress:
    rank: int
    host: str
    steps: int
    collectives: int
    phase: str | None
    in_collective: str | None
    since_step_s: float  # seconds since this rank last closed a step (its own clock)
    silent_s: float  # seconds since the collector last heard from it
    finished: bool = False
    agent_off: bool = False  # the agent stopped timing: its step count says nothing

    def position(self) -> tuple[int, int, int]:
        return (self.steps, self.collectives, PHASE_ORDER.get(self.phase, 0))

    def where(self) -> str:
        if self.in_collective:
            return f"in {self.in_collective}"
        return f"in {self.phase}" if self.phase else "between phases"


@dataclass(frozen=True, slots=True)
class HangReport:
    kind: str
    diagnosis: Diagnosis
    culprits: tuple[int, ...]
    stalled_s: float
    threshold_s: float


def threshold(median_step_ms: float | None, override_s: float | None = None) -> float:
    if override_s is not None:
        return override_s
    step_s = (median_step_ms or 0.0) / 1000.0
    return max(HANG_FLOOR_S, HANG_STEPS * step_s)


def _ranks(ranks: Sequence[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:6])
    return shown + (f" and {len(ranks) - 6} more" if len(ranks) > 6 else "")


def detect(progress: Sequence[RankProgress], median_step_ms: float | None,
           override_s: float | None = None) -> HangReport | None:
    """A HangReport when no running rank closed a step for longer than the threshold."""
    running = [p for p in progress if not p.finished and not p.agent_off]
    if not running or not any(p.steps > 0 for p in running):
        return None  # nothing stepped yet: loading a model is not a hang
    limit = threshold(median_step_ms, override_s)
    stalled = min(p.since_step_s + p.silent_s for p in running)
    if stalled <= limit:
        return None
    dead = sorted(p.rank for p in running if p.silent_s > DEAD_SILENCE_S)
    if dead:
        first = next(p for p in running if p.rank == dead[0])
        summary = (f"HANG: rank{'s' if len(dead) > 1 else ''} {_ranks(dead)} stopped reporting "
                   f"{first.silent_s:.0f} s ago (host {first.host}, last seen at step "
                   f"{first.steps} {first.where()}): the process is gone or frozen. Check its "
                   f"log and the host (OOM killer, a crash, a hung driver).")
        return HangReport(DEAD, Diagnosis(HANG, dead[0], first.phase, CRITICAL, summary),
                          tuple(dead), stalled, limit)
    ahead = max(p.position() for p in running)
    behind = sorted(p.rank for p in running if p.position() < ahead)
    if behind:
        first = next(p for p in running if p.rank == behind[0])
        leader = next(p for p in running if p.position() == ahead)
        summary = (f"No step anywhere for {limit:.0f}+ s: the other ranks wait for rank"
                   f"{'s' if len(behind) > 1 else ''} {_ranks(behind)} (host {first.host}), "
                   f"at step {first.steps} {first.where()} after {first.collectives} "
                   f"collectives, while rank {leader.rank} is at step {leader.steps} "
                   f"{leader.where()} after {leader.collectives}. Its stack shows where it is: "
                   f"a collective only some ranks call, or work stuck on that rank.")
        return HangReport(BEHIND, Diagnosis(HANG, behind[0], first.phase, CRITICAL, summary),
                          tuple(behind), stalled, limit)
    sample = running[0]
    summary = (f"No step anywhere for {limit:.0f}+ s: every rank is at step {sample.steps} "
               f"{sample.where()} after {sample.collectives} collectives. All stuck in the "
               f"same place points at the fabric or the collective itself: a shape mismatch, "
               f"a network or NCCL problem (try NCCL_DEBUG=INFO, nccl-tests).")
    return HangReport(SAME_COLLECTIVE, Diagnosis(HANG, None, sample.phase, CRITICAL, summary),
                      (), stalled, limit)
