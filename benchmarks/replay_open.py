"""How long `traceml watch RUN_DIR` takes to open a big record, and its peak memory.

    python benchmarks/replay_open.py [--ranks 16384] [--steps 100000] [--budget-mib 256]

Synthesises the record of a RANKS x STEPS run with the real step-log writer (its columns,
as the collector writes a relay's batches; one straggler rank from the middle of the
kept steps on) and a final_summary.json, then, in a fresh process, opens it as the
dashboard does (collect/replay.py: read the log, feed the judge, build the keyframes,
decode the last) and reports the time and the peak RSS.

The step log is bounded by its byte budget (runfolder/step_log.py, 256 MiB): whatever the
run's length, the disk holds its newest records only, two files of at most half the
budget each. Writing all STEPS steps would only rotate the older ones away, so the
record is written from the step where the budget is filled to the last step: on disk
the same files the whole run leaves (its last steps), in minutes instead of hours.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from traceml_agent.vocab import PHASES
from traceml_tui.runfolder.layout import RunFolder
from traceml_tui.runfolder.step_log import StepLogWriter

T0 = 1_700_000_000.0
STEP_S = 1.0  # a wide job's step: one a second
# Bytes a record takes in columns: rank, step, t_end, step_ms, and 8 per phase.
RECORD_BYTES = 8 * (4 + len(PHASES))


def synthesise(run_dir: Path, ranks: int, steps: int, budget: int) -> tuple[int, int, float]:
    """The record's files; (first step kept, records written, seconds spent)."""
    run_dir.mkdir(mode=0o700, parents=True)
    per_step = ranks * RECORD_BYTES
    kept = max(1, budget // per_step)  # what the budget holds, both files together
    first = max(0, steps - kept)
    start = time.perf_counter()
    rng = np.random.default_rng(0)
    base = np.array([5.0, np.nan, 300.0, 500.0, 50.0, 80.0, 20.0])
    rank = np.arange(ranks, dtype=np.int64)
    slow = ranks // 3
    written = 0
    with StepLogWriter(RunFolder(run_dir).step_log, budget_bytes=budget) as log:
        for step in range(first, steps):
            values = np.tile(base, (ranks, 1)) * (1 + 0.02 * rng.random((ranks, len(PHASES))))
            if step >= first + (steps - first) // 2:  # a straggler from the middle on
                values[slow, 0] += 400.0
                values[np.arange(ranks) != slow, 4] += 400.0
            step_ms = np.nansum(values, axis=1)
            t_end = T0 + step * STEP_S + step_ms / 1000
            log.append_columns(PHASES, rank, np.full(ranks, step, dtype=np.int64), t_end,
                               step_ms, values)
            written += ranks
    doc = {"complete": True, "failure": None,
           "run": {"name": "big", "world_size": ranks, "nnodes": max(1, ranks // 8),
                   "started_at": "2023-11-14T22:13:20+00:00",
                   "ended_at": time.strftime("%Y-%m-%dT%H:%M:%S+00:00",
                                             time.gmtime(T0 + steps * STEP_S + 5)),
                   "exit_code": 0, "steps": steps},
           "ranks": [{"rank": r, "node": r // 8, "host": f"node{r // 8:04d}", "device": "cuda"}
                     for r in range(ranks)]}
    RunFolder(run_dir).summary_json.write_text(json.dumps(doc))
    return first, written, time.perf_counter() - start


OPEN = """
import resource, sys, time
from pathlib import Path
t = time.perf_counter()
from traceml_tui.collect.replay import Replay, open_record
replay = Replay(open_record(Path(sys.argv[1])))
replay.load()
loaded = time.perf_counter() - t
last = replay.view(len(replay) - 1)
shown = time.perf_counter() - t
t = time.perf_counter()
replay.view(len(replay) // 2)
move = time.perf_counter() - t
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
kb = sum(len(f.data) for f in replay.frames) / 1024
print(f"{replay.records} {len(replay)} {loaded:.2f} {shown:.2f} {move * 1000:.1f} {rss:.0f} "
      f"{kb:.0f} {last.label.replace(' ', '_')} {last.rank}")
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=16_384)
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--budget-mib", type=int, default=256)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "big"
        first, written, spent = synthesise(run_dir, args.ranks, args.steps,
                                           args.budget_mib << 20)
        size = sum(f.stat().st_size for f in RunFolder(run_dir).step_log.iterdir())
        print(f"record: {args.ranks:,} ranks x {args.steps:,} steps; the step log's "
              f"{args.budget_mib} MiB budget keeps steps {first:,}-{args.steps - 1:,}: "
              f"{written:,} records written in {spent:.1f} s, {size / 2**20:.0f} MiB on disk")
        out = subprocess.run([sys.executable, "-c", OPEN, str(run_dir)], capture_output=True,
                             text=True, check=True).stdout.split()
        records, frames, loaded, shown, move, rss, kb, label, rank = out
        print(f"open: {int(records):,} records read and judged, {frames} keyframes "
              f"({float(kb) / 1024:.0f} MiB encoded) in {loaded} s; the end shown after "
              f"{shown} s; a cursor move decodes in {move} ms; peak RSS {rss} MiB")
        print(f"last keyframe: {label.replace('_', ' ')} rank {rank}")
    print(f"(python {sys.version.split()[0]}, {os.cpu_count()} CPUs; "
          f"this process's peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB)")


if __name__ == "__main__":
    main()
