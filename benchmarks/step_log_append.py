"""Cost of logging one step record in traceml_tui.runfolder.step_log (the collector's hot path).

    python benchmarks/step_log_append.py [--records 500000] [--rounds 5]

Appends pre-built records (7 phases, one None, as a real agent sends them) in batches
of 10 (an agent's batch at ~100 steps/s) and of 1, with a budget small enough that the
run rotates files several times, so writes, flushes and rotations are all in the figure.
Prints the median and range over rounds of wall time per record, and bytes per record.
The collector ingests ~10k records/s at 1,024 ranks. Measured on the project's 2-vCPU VM
(Python 3.11.7, msgpack 1.2.4): 0.48 µs/record in batches of 10 (range 0.48-0.54 over 7
rounds of 500k), 0.9-1.0 µs one at a time; ~85 bytes a record on disk. At 10k records/s
that is ~5 ms of CPU a second, 0.5% of a core.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from traceml_agent.protocol import PHASES, StepRecord
from traceml_tui.runfolder.step_log import StepLogWriter, read_steps


def one_round(records: list[StepRecord], batch: int, budget: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        writer = StepLogWriter(tmp, budget_bytes=budget)
        t0 = time.perf_counter()
        for i in range(0, len(records), batch):
            writer.append_records(i % 1024, PHASES, records[i:i + batch])
        writer.close()
        elapsed = time.perf_counter() - t0
        assert writer.errors == 0 and writer.dropped == 0 and writer.records == len(records)
        kept = sum(1 for _ in read_steps(tmp))
        size = sum(p.stat().st_size for p in Path(tmp).iterdir())
        return elapsed / len(records) * 1e6, size / kept


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=500_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budget-mib", type=int, default=16)
    args = parser.parse_args()
    t = 1.79e9
    records = [StepRecord(i, t + i * 0.01, 12.5 + i % 7,
                          (1.25, None, 3.5, 4.75, 0.5, 2.25, 0.25)) for i in range(args.records)]
    for batch in (10, 1):
        costs = [one_round(records, batch, args.budget_mib << 20)[0] for _ in range(args.rounds)]
        print(f"batch {batch:>2}: {statistics.median(costs):.2f} µs/record median "
              f"(range {min(costs):.2f}-{max(costs):.2f}) over {args.rounds} rounds "
              f"of {args.records} records")
    _, per_record = one_round(records, 10, args.budget_mib << 20)
    print(f"disk: ~{per_record:.0f} bytes/record kept ({args.budget_mib} MiB budget)")


if __name__ == "__main__":
    main()
