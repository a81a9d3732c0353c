"""The live file's content (snapshot + summary + JSON, as collector.write_live makes it)
with its whole-window part taken fresh vs reused (WindowPart, collector.WINDOW_REFRESH_S),
in-process, CPU milliseconds, alternated rounds in one process (this VM's speed drifts).
A live file every 2 s with the part refreshed every 10 s costs (fresh + 4 x reused) / 5
a write. One JSON line per world size.

Usage: python benchmarks/live_file.py [--ranks N ...] [--rounds R]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from traceml_tui.collect.canned import T0, make_state
from traceml_tui.judge.state import RunState
from traceml_tui.report import summary


def write(state: RunState, clock: list[float], age: float) -> float:
    """One live file's content, CPU ms; `clock`: the collector's, a write every 2 s."""
    clock[0] += 2.0
    t0 = time.process_time()
    with summary.gc_paused():
        snap = state.snapshot(T0 + 100.0 + clock[0], clock[0], full=True,
                              window_max_age_s=age)
        summary.to_json(summary.build(snap, summary.RunMeta(complete=False)))
        del snap
    return (time.process_time() - t0) * 1000


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, nargs="+", default=[1024])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    for ranks in args.ranks:
        state = make_state(world_size=ranks, nproc_per_node=8, steps=args.steps,
                           straggler=ranks // 3)
        clock = [0.0]
        write(state, clock, 0.0)
        fresh, reused = [], []
        for _ in range(args.rounds):
            fresh.append(write(state, clock, 0.0))  # takes a new part ...
            reused.append(write(state, clock, 1e9))  # ... which the next write reuses
        f, r = statistics.median(fresh), statistics.median(reused)
        print(json.dumps({"ranks": ranks, "window_steps": state.window_steps,
                          "fresh_ms": round(f, 1), "reused_ms": round(r, 1),
                          "per_write_at_10s_ms": round((f + 4 * r) / 5, 1),
                          "fresh_all": [round(x, 1) for x in fresh],
                          "reused_all": [round(x, 1) for x in reused]}), flush=True)


if __name__ == "__main__":
    main()
