"""Decode + ingest per message, in-process: what one agent message costs the collector
before libzmq and CURVE (collector_ingest.py measures those too).

A RunState of --ranks ranks (default 1,024) gets one-record steps messages, as an agent
sends ~10 times a second, each decoded from its msgpack bytes (protocol.decode) and
ingested (RunState.ingest, into the ranks' numpy windows). Prints one JSON line:
decode_us (median of 3 passes) and decode_ingest_us per message, and the message size.

Usage: python benchmarks/decode_ingest.py [--ranks N] [--steps K]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from traceml_agent import protocol
from traceml_agent.protocol import PHASES, Identity
from traceml_tui.judge.state import RunState


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20, help="messages per rank")
    args = p.parse_args()
    n, k = args.ranks, args.steps
    state = RunState("bench", world_size=n, nnodes=max(1, n // 8))
    ids = [Identity(r, r % 8, r // 8, f"node{r // 8:03d}", 1000 + r, n) for r in range(n)]
    for r in range(n):
        state.ingest(protocol.decode(protocol.encode("hello", ids[r], 0, 1.0, run="bench")), 1.0)
    record = [5.0, None, 30.0, 50.0, 4.0, 8.0, 3.0]
    payloads = [[protocol.encode("steps", ids[r], s, 1.0, phases=list(PHASES),
                                 records=[[s, 1.0 + s, 100.0, *record]], dropped=0,
                                 forced=[0] * len(PHASES)) for r in range(n)]
                for s in range(1, k + 1)]

    def per_message(ingest: bool) -> float:
        t0 = time.process_time()
        for batch in payloads:
            for payload in batch:
                msg = protocol.decode(payload)
                if ingest:
                    state.ingest(msg, 2.0)
        return (time.process_time() - t0) / (n * k) * 1e6

    decode_us = statistics.median(per_message(False) for _ in range(3))
    both_us = per_message(True)  # once: steps must increase
    print(json.dumps({"ranks": n, "decode_us": round(decode_us, 2),
                      "decode_ingest_us": round(both_us, 2), "bytes": len(payloads[0][0])}))


if __name__ == "__main__":
    main()
