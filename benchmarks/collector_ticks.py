"""The collector's periodic work at N ranks, in-process and without traffic: one live
evaluation (every rank's recent window, the hang check, the diagnosis), a full snapshot
(every rank's whole window) and the live snapshot file's content (snapshot + summary +
JSON), from a state holding --steps steps of every rank (traceml_tui/collect/canned.py:
synthetic records through the real protocol and RunState). CPU milliseconds, median of 5.
One JSON line.

Usage: python benchmarks/collector_ticks.py [--ranks N] [--steps K]
"""

from __future__ import annotations

import argparse
import contextlib
import json

from inprocess import MONO_NOW, NOW, canned_state, cpu_ms

from traceml_tui import viewmodel
from traceml_tui.collect import view_build
from traceml_tui.report import summary


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--steps", type=int, default=600, help="steps per rank (fills the window)")
    args = p.parse_args()
    state = canned_state(args.ranks, args.steps)
    now, mono_now = NOW, MONO_NOW

    def evaluate() -> None:
        for rs in state.ranks.values():
            rs.dirty = True  # as after a tick in which every rank stepped
        state.evaluate(now, mono_now)  # with the hang check, as the collector runs it

    def live_file() -> None:  # as the collector writes it (collector.write_live)
        with getattr(summary, "gc_paused", contextlib.nullcontext)():
            snap = state.snapshot(now, 0.0, full=True)
            summary.to_json(summary.build(snap, summary.RunMeta(complete=False)))
            del snap

    def view() -> None:
        viewmodel.encode_view(view_build.build(state.snapshot(now, 0.0), state.recent_steps))

    print(json.dumps({"ranks": args.ranks, "window_steps": state.window_steps,
                      "evaluate_ms": cpu_ms(evaluate),
                      "full_snapshot_ms": cpu_ms(lambda: state.snapshot(now, 0.0, full=True)),
                      "live_file_ms": cpu_ms(live_file),
                      # as in the collector: the live file after an evaluation in which
                      # every rank stepped (its live timings are fresh, not yet read)
                      "live_file_after_eval_ms": cpu_ms(live_file, evaluate),
                      "view_ms": cpu_ms(view)}))


if __name__ == "__main__":
    main()
