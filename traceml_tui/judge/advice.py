"""A periodic stall's advice, chosen by what the evidence shows (docs/diagnosis.md,
"Advice from evidence").

The stall log says which rank stalls, how often, in which phase, and whether every rank
stalls together; the agent's heartbeat adds what only the rank's process knows: its
garbage collector's pauses (agent/gcwatch.py) and the DataLoader feeding its steps (its
length, its epochs, its workers and whether they persist). One advice for every stall
(make the checkpoint asynchronous, run evaluation on every rank) was wrong for a
DataLoader restarting its workers each epoch and silent about the collector; a table of
(cause, evidence, advice) rows picks the first row whose evidence holds, and says so
when none does rather than guess.

Pure functions over a StallFinding (with the rank's last heartbeat) and the stall's
scope: no I/O, no clocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from traceml_agent.protocol import Heartbeat
from traceml_agent.vocab import DATALOADER, FORWARD, OPTIMIZER, WAIT

from .stalls import PERIOD_TOLERANCE, StallFinding

# The garbage collector explains a rank's stalls when its slow pauses (gcwatch.SLOW_GC_MS,
# counted from the first step) number at least GC_SHARE of its periodic stalls and add up
# to at least GC_SHARE of its periodic stalls' excess over the run, and its
# longest pause is at least GC_PAUSE_SHARE of a typical stall: a collector that only
# nibbles a few ms while 400 ms checkpoints stall the rank is not the cause.
GC_SHARE = 0.5
GC_PAUSE_SHARE = 0.5
# A stall at each epoch start recurs every len(loader) steps: the period must match the
# loader's length within the stall log's own tolerance (PERIOD_TOLERANCE, at least a
# step), and the loader must have been seen to start an epoch more than once.
MIN_EPOCHS = 2
# The phases at the step boundary, where a save between steps shows.
BOUNDARY_PHASES = frozenset({WAIT, OPTIMIZER})
# The rank that writes checkpoints, evaluates and logs in most training scripts.
LEAD_RANK = 0


class Scope(NamedTuple):
    """What the stall log and the agent say about one periodic stall."""

    stall: StallFinding
    everyone: bool  # every reporting rank stalls with it
    hb: Heartbeat | None  # the stalling rank's newest heartbeat (None: none yet)


class Advice(NamedTuple):
    cause: str | None  # the row's cause; None: the evidence picks none
    text: str  # one or two sentences naming the evidence, then the fix


class Row(NamedTuple):
    cause: str
    holds: Callable[[Scope], bool]  # the evidence predicate
    advise: Callable[[Scope], str]  # the advice, with the evidence's numbers


def _who(s: Scope) -> str:
    return "every rank" if s.everyone else f"rank {s.stall.rank}"


def _gc(s: Scope) -> bool:
    hb, f = s.hb, s.stall
    return (hb is not None and hb.gc_slow > 0 and _periodic_ms(f) > 0
            and hb.gc_slow >= GC_SHARE * f.periodic_count
            and hb.gc_slow_ms >= GC_SHARE * _periodic_ms(f)
            and hb.gc_max_ms >= GC_PAUSE_SHARE * f.periodic_ms)


def _periodic_ms(f: StallFinding) -> float:
    """The periodic stalls' excess over the run (not the rank's hiccups between them)."""
    return f.periodic_count * f.periodic_ms


def _gc_advice(s: Scope) -> str:
    hb, f = s.hb, s.stall
    assert hb is not None
    return (f"The garbage collector paused rank {f.rank} {hb.gc_slow} times for up to "
            f"{hb.gc_max_ms:.0f} ms ({hb.gc_slow_ms / 1000:.1f} s in all, against "
            f"{_periodic_ms(f) / 1000:.1f} s of stalls; {hb.gc_full} full collections): call "
            f"gc.freeze() after set-up (model, data, caches), raise the thresholds "
            f"(gc.set_threshold), or gc.disable() and gc.collect() at the same step on "
            f"every rank.")


def _epoch_start(s: Scope) -> bool:
    hb, f = s.hb, s.stall
    if hb is None or f.phase != DATALOADER or f.period is None or not hb.loader_len:
        return False
    near = abs(f.period - hb.loader_len) <= max(1.0, PERIOD_TOLERANCE * hb.loader_len)
    return (near and hb.loader_epochs >= MIN_EPOCHS and bool(hb.loader_workers)
            and hb.loader_persistent is False)


def _epoch_start_advice(s: Scope) -> str:
    hb = s.hb
    assert hb is not None
    return (f"The stalls recur every {s.stall.period} steps = the DataLoader's length "
            f"({hb.loader_len} batches), in dataloader on {_who(s)}: its "
            f"{hb.loader_workers} workers start again every epoch "
            f"(persistent_workers=False). Set persistent_workers=True (or make the "
            f"workers start faster: less work in worker_init_fn and the dataset's "
            f"construction).")


def _lead_alone(s: Scope, phases: frozenset[str]) -> bool:
    return not s.everyone and s.stall.rank == LEAD_RANK and s.stall.phase in phases


def _checkpoint_advice(s: Scope) -> str:
    return (f"Rank {LEAD_RANK} alone stalls at the step boundary ({s.stall.phase}) every "
            f"{s.stall.period} steps: the pattern of a checkpoint saved on rank "
            f"{LEAD_RANK}. Make it asynchronous (torch.distributed.checkpoint.async_save) "
            f"or save less often.")


def _evaluation_advice(s: Scope) -> str:
    return (f"Rank {LEAD_RANK} alone stalls in forward every {s.stall.period} steps: "
            f"the pattern of evaluation or logging on rank {LEAD_RANK} (an extra model "
            f"call, a metric). Run evaluation on every rank (sharded) or off the critical "
            f"path; log from a background thread.")


# First row whose evidence holds gives the advice: the agent's own evidence (the
# collector's pauses, the loader's epochs) before the patterns read from where and who.
ADVICE: tuple[Row, ...] = (
    Row("garbage collection", _gc, _gc_advice),
    Row("DataLoader workers restarted every epoch", _epoch_start, _epoch_start_advice),
    Row("checkpoint on rank 0", lambda s: _lead_alone(s, BOUNDARY_PHASES),
        _checkpoint_advice),
    Row("evaluation or logging on rank 0", lambda s: _lead_alone(s, frozenset({FORWARD})),
        _evaluation_advice),
)


def advise(stall: StallFinding, everyone: bool, hb: Heartbeat | None) -> Advice:
    """The advice of the first ADVICE row whose evidence holds; else one that says the
    evidence picks no cause and what to look at."""
    scope = Scope(stall, everyone, hb)
    for row in ADVICE:
        if row.holds(scope):
            return Advice(row.cause, row.advise(scope))
    return Advice(None, (
        f"The evidence does not pick a cause (no garbage-collection pauses to match, not "
        f"the loader's epoch boundary): look at what {_who(scope)} does every "
        f"{stall.period} steps. A checkpoint: make it asynchronous "
        f"(torch.distributed.checkpoint.async_save); evaluation: on every rank or off the "
        f"critical path; logging: from a background thread."))
