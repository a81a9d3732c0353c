"""The summary document built and encoded from a full snapshot, in-process: what the
collector does for the live file every few seconds and for the record at the end
(report/summary.py `build` + `to_json`). CPU milliseconds, median of 7, one JSON line;
`code` says which tree was imported, so an old commit runs the same script with its
tree on PYTHONPATH (a folder linking its traceml_tui, and its agent as traceml_agent).

Usage: python benchmarks/summary_build.py [RANKS ...]
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import traceml_tui
from traceml_tui.collect.canned import make_state
from traceml_tui.report import summary


def main() -> None:
    for ranks in [int(a) for a in sys.argv[1:]] or [1024, 16384]:
        # Full 600-step windows at 1,024; 64 steps at 16,384 (the window's size does not
        # enter the document, only its quantiles, and a full one takes minutes to make).
        state = make_state(world_size=ranks, nproc_per_node=8,
                           steps=600 if ranks <= 1024 else 64, straggler=ranks // 3)
        snap = state.snapshot(1_700_000_100.0, 0.0, full=True)

        def once(snap: object = snap) -> None:
            with summary.gc_paused():
                summary.to_json(summary.build(snap, summary.RunMeta(complete=False)))

        once()
        times = []
        for _ in range(7):
            start = time.process_time()
            once()
            times.append((time.process_time() - start) * 1000)
        print(json.dumps({"code": traceml_tui.__file__, "ranks": ranks,
                          "build_and_encode_ms": round(statistics.median(times), 1)}))


if __name__ == "__main__":
    main()
