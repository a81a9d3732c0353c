"""`traceml report` on a large synthetic record: time, peak RSS and the HTML's size.

Builds a step log of RANKS x STEPS records through the real writer (runfolder/
step_log.py, in columns as the collector writes them, within its default byte budget, so
the oldest records rotate away as on a real run), a summary of RANKS ranks with one
straggler and a few episodes, then runs the report in this process.

    python benchmarks/report_size.py [RANKS] [STEPS]
"""

from __future__ import annotations

import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from traceml_tui.report.html_report import write_report
from traceml_tui.runfolder import summary_model as model
from traceml_tui.runfolder.layout import RunFolder
from traceml_tui.runfolder.step_log import StepLogWriter

PHASES = ("dataloader", "h2d", "forward", "backward", "sync", "optimizer", "wait")


def main() -> None:
    ranks = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 20_000
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = RunFolder(Path(tmp))
        t0 = time.perf_counter()
        with StepLogWriter(folder.step_log) as w:
            rank = np.arange(ranks, dtype=np.int64)
            for s in range(steps):
                phase = rng.gamma(4.0, 1.0, (ranks, len(PHASES)))
                phase[7 % ranks, 2] += 25.0  # the straggler's forward
                step_ms = phase.sum(axis=1)
                w.append_columns(PHASES, rank, np.full(ranks, s), np.full(ranks, s * 0.04),
                                 step_ms, phase)
        records = w.records
        built = time.perf_counter() - t0
        doc = {"run": {"name": "synthetic", "world_size": ranks, "steps": steps * ranks},
               "phases": list(PHASES),
               "diagnosis": {"label": "COMPUTE STRAGGLER", "rank": 7 % ranks,
                             "phase": "forward", "severity": "critical",
                             "summary": "Rank 7 spends 25 ms more in forward."},
               "step_ms": {"median": 28.0},
               "ranks": [{"rank": r, "host": f"node{r // 8}", "steps": steps,
                          "step_ms": {"median": 28.0 + (r == 7)},
                          "phase_ms": {p: {"median": 4.0} for p in PHASES}}
                         for r in range(ranks)],
               "timeline": [{"label": "COMPUTE STRAGGLER", "rank": 7, "start_step": s,
                             "end_step": s + 500, "severity": "critical"}
                            for s in range(0, steps, max(steps // 8, 1))]}
        folder.summary_json.write_bytes(model.encode(doc))
        t0 = time.perf_counter()
        out, facts = write_report(folder.root)
        took = time.perf_counter() - t0
        size = out.stat().st_size
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"ranks={ranks} steps={steps}: step log {records} records written in {built:.1f} s, "
          f"{facts['records']} kept and read by the report")
    print(f"report: {took:.1f} s, peak RSS {peak:.0f} MB (whole process), "
          f"{size / 1e6:.2f} MB HTML")


if __name__ == "__main__":
    main()
