"""Canned states evaluated live, dumped as JSON: run under two versions of the collector
(tests/judge/test_judge_columnar.py), the dumps must be identical.

Usage: python tests/support/columnar_cases.py WORLD_SIZE  (prints one JSON document)

Only APIs that both the per-rank judgement (36da305) and the columnar one have are used:
canned.make_state / make_hang_state, RunState.ingest / evaluate / snapshot, and a few
RankState fields edited by hand (GPU health, forced closes, heartbeats, FSDP).
"""

from __future__ import annotations

import json
import random
import sys
from typing import Any

from msgspec.structs import replace

from traceml_agent.protocol import PHASES, PROTOCOL_VERSION, Message, StepRecord, Steps
from traceml_agent.vocab import BACKWARD, DATALOADER, FORWARD, OPTIMIZER, SYNC, WAIT
from traceml_tui.collect import canned
from traceml_tui.judge import diagnosis as dx

T0 = canned.T0


def more_steps(state: Any, rank: int, n: int, slow: dict[str, float], seed: int = 1) -> None:
    """`n` more steps of one rank, its phases as canned's base plus `slow`."""
    rs = state.ranks[rank]
    rng = random.Random(seed + rank)
    records = []
    for i in range(n):
        values = {p: (None if v is None else v * (1 + 0.05 * rng.random()) + slow.get(p, 0.0))
                  for p, v in canned.BASE_MS.items()}
        step_ms = sum(v for v in values.values() if v is not None)
        step = rs.last_step + 1 + i
        records.append(StepRecord(step, T0 + step * step_ms / 1000, step_ms,
                                  tuple(values.get(p) for p in PHASES)))
    batch = Steps(v=PROTOCOL_VERSION, id=rs.ident, seq=0, t=T0, phases=list(PHASES),
                  records=[])
    state.ingest(Message("steps", rs.ident, 0, T0, batch, PHASES, tuple(records)), 0.0)


def states(world: int) -> dict[str, Any]:
    node = 8
    every = tuple(range(world))
    mid = world // 3
    first = (mid // node) * node
    out: dict[str, Any] = {
        "input straggler": canned.make_state(world, node, straggler=mid),
        "compute straggler": canned.make_state(world, node, straggler=mid, phase=FORWARD,
                                               extra_ms=3.0),
        "two stragglers": canned.make_state(world, node, straggler=mid, also_slow=(5,),
                                            phase=BACKWARD),
        "node straggler": canned.make_state(world, node, straggler=first + 3,
                                            also_slow=tuple(range(first, first + node))),
        "compute node straggler": canned.make_state(
            world, node, straggler=first + 3, also_slow=tuple(range(first, first + node)),
            phase=FORWARD, extra_ms=6.0),
        "input bound": canned.make_state(world, node, straggler=None, also_slow=every,
                                         extra_ms=3.0),
        "balanced": canned.make_state(world, node, straggler=None),
        "wait heavy": canned.make_state(world, node, straggler=None, also_slow=every,
                                        phase=WAIT, extra_ms=3.0),
        "comm bound": canned.make_state(world, node, straggler=None, also_slow=every,
                                        phase=SYNC, extra_ms=9.0),
        "optimizer straggler fsdp": canned.make_state(world, node, straggler=mid,
                                                      phase=OPTIMIZER, extra_ms=2.0),
        "stale ranks": canned.make_state(world, node, straggler=mid, stale=(1, 2, world - 1)),
        "hang": canned.make_hang_state(world),
    }
    # Edited timings: gradient bytes for comm-bound's bandwidth evidence, uneven per rank.
    for r, rs in out["comm bound"].ranks.items():
        rs.heartbeat = replace(rs.heartbeat, grad_bytes=100_000_000 + (r % 3) * 1_000_000)
        rs.dirty = True
    # GPU health beside the compute straggler: its GPU throttled and clocked low.
    for r, rs in out["compute straggler"].ranks.items():
        rs.gpu = (dx.GpuHealth(1500.0, ("hw thermal",), 250.0, 90.0) if r == mid
                  else dx.GpuHealth(1980.0 - r % 7, (), 300.0, 60.0))
        rs.dirty = True
    # The whole slow node's GPUs clock low.
    for r, rs in out["compute node straggler"].ranks.items():
        rs.gpu = dx.GpuHealth(1400.0 if first <= r < first + node else 1980.0)
        rs.dirty = True  # as a "sys" message would: ingest refreshes the rank's live GPU
    out["optimizer straggler fsdp"].parallel = "fsdp"
    # A phase closed without its end hook on some ranks: TIMING INCOMPLETE.
    incomplete = canned.make_state(world, node, straggler=None)
    for r in (3, 4, world - 2):
        incomplete.ranks[r].forced = {FORWARD: 9}
        incomplete.ranks[r].dirty = True
    out["timing incomplete"] = incomplete
    # A straggler that recovered: slow over the window, not over its newest steps.
    recovered = canned.make_state(world, node, straggler=mid, extra_ms=6.0)
    more_steps(recovered, mid, 12, {})
    out["recovered straggler"] = recovered
    # One more slow step everywhere but a straggler still slow: the window moves on.
    moving = canned.make_state(world, node, straggler=mid, phase=DATALOADER, extra_ms=2.5)
    for r in range(0, world, max(1, world // 16)):
        more_steps(moving, r, 3, {SYNC: 2.5} if r != mid else {DATALOADER: 2.5})
    out["moving window"] = moving
    # A rank whose own steps stall every 10 steps (its stall log): PERIODIC STALL.
    stalling = canned.make_state(world, node, straggler=None)
    for i in range(6):
        more_steps(stalling, 7, 9, {}, seed=i)
        more_steps(stalling, 7, 1, {WAIT: 80.0}, seed=i)
    out["periodic stall"] = stalling
    # Slow in input and in compute over the whole window: STRAGGLER.
    both = canned.make_state(world, node, straggler=mid)
    more_steps(both, mid, both.window_steps, {DATALOADER: 20.0, FORWARD: 20.0})
    out["straggler in both"] = both
    out["warm-up"] = canned.make_state(world, node, steps=5, straggler=mid)
    return out


def _diagnosis(d: Any) -> dict[str, Any] | None:
    if d is None:
        return None
    out = d.to_json()
    out["raw"] = [d.gap_ms, d.gap_share, d.period]  # unrounded: the figures themselves
    return out


def _what_if(w: Any) -> dict[str, Any] | None:
    if w is None:
        return None
    out = w.to_json()
    out["raw"] = [w.now_ms, w.step_ms, w.excess_ms, w.paid_ms]
    return out

def _history(state):
    """The time chart's history: the timeline's (timeline.py), or the state's in the old
    code the comparison runs beside this one."""
    return state.timeline.history if hasattr(state.timeline, "history") else state.history


def dump(state: Any, now: float, mono_now: float) -> dict[str, Any]:
    ticks = []
    for tick in range(3):
        if tick == 1:  # as after a tick in which every rank stepped (the benchmark's)
            for rs in state.ranks.values():
                rs.dirty = True
        shown = state.evaluate(now + tick, mono_now + tick)
        ticks.append({
            "shown": _diagnosis(shown),
            "what_if": _what_if(state.what_if),
            "hidden": {str(k): v for k, v in sorted(state.hidden.items())},
            "hang": None if state.hang is None else [state.hang.kind,
                                                     list(state.hang.culprits)],
            "history": [list(p) for p in _history(state).view()],
            "timeline": [[e.label, e.rank, e.node, e.start, e.end, e.lost_s]
                         for e in state.timeline],
            "stall_at_ms": [state.ranks[r].stall_at_ms for r in sorted(state.ranks)[:4]],
        })
    snap = state.snapshot(now + 10, mono_now + 3, full=True)
    return {"ticks": ticks, "final": _diagnosis(snap.final),
            "final_what_if": _what_if(snap.final_what_if)}


def main() -> None:
    world = int(sys.argv[1])
    out = {name: dump(state, T0 + 100.0, 0.5)
           for name, state in states(world).items()}
    print(json.dumps(out, sort_keys=True))


if __name__ == "__main__":
    main()

