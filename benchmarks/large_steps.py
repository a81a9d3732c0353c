"""A large steps message's cost to the collector, in-process: checked as columns
(collect/steps_columns.py) vs record by record (protocol.decode, the path before issue 42).

A Collector (its real _receive: decode, ownership, ingest, step log) on a 2-rank run gets
steps messages of --records records (default 9,000: ~0.75 MiB, a key holder's flood in
tests/collect/test_security_drain.py), either from another connection than the rank's (refused:
not_owner) or as the rank's own next batch (taken). The per-message path is the same code
with steps_columns.LARGE_BYTES out of reach. Prints one JSON line per case: CPU ms per
message, median of --rounds rounds of --messages messages, both paths in each round.

Usage: python benchmarks/large_steps.py [--records N] [--messages M] [--rounds R]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from traceml_agent import protocol
from traceml_agent.protocol import PHASES, Identity
from traceml_tui.collect import steps_columns
from traceml_tui.collect.collector import Collector
from traceml_tui.judge.state import RunState

T0 = 1_700_000_000.0


def _payload(ident: Identity, seq: int, first: int, n: int) -> bytes:
    recs = [[s, T0 + s * 0.1, 100.0, *[1.0, None, 30.0, 50.0, 4.0, 8.0, 3.0][:len(PHASES)]]
            for s in range(first, first + n)]
    return protocol.encode("steps", ident, seq, T0, phases=list(PHASES), records=recs,
                           dropped=0)


def _round(large: bool, refused: bool, n: int, messages: int) -> float:
    steps_columns.LARGE_BYTES = 16 << 10 if large else 1 << 40
    with tempfile.TemporaryDirectory() as tmp:
        coll = Collector(Path(tmp), RunState("bench", 2, started_at=T0))
        try:
            ident = Identity(0, 0, 0, "h", 100, 2)
            coll._receive([b"rank0", _payload(ident, 0, 0, 3)], 1.0)
            other = Identity(0, 0, 0, "h", 4_000_000, 2)
            # Steps stay within the state's rate bound: its clock advances with them.
            frames = [[b"flood" if refused else b"rank0",
                       _payload(other if refused else ident, i + 1, 3 + i * n, n)]
                      for i in range(messages)]
            cpu = time.process_time()
            for i, f in enumerate(frames):
                coll._receive(f, 1.0 + (i + 1) * n / 1000.0)
                coll.flush_columns()
            return (time.process_time() - cpu) * 1e3 / messages
        finally:
            coll.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--records", type=int, default=9_000)
    p.add_argument("--messages", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    size = len(_payload(Identity(0, 0, 0, "h", 100, 2), 1, 0, a.records))
    for refused in (True, False):
        got: dict[str, list[float]] = {"columns": [], "per_record": []}
        for _ in range(a.rounds):
            got["columns"].append(_round(True, refused, a.records, a.messages))
            got["per_record"].append(_round(False, refused, a.records, a.messages))
        print(json.dumps({"case": "refused (another connection's rank)" if refused
                          else "taken (the rank's own next batch)",
                          "records": a.records, "bytes": size,
                          **{f"{k}_cpu_ms": round(statistics.median(v), 2)
                             for k, v in got.items()},
                          **{f"{k}_range": [round(min(v), 2), round(max(v), 2)]
                             for k, v in got.items()}}))


if __name__ == "__main__":
    main()
