"""An honest rank's message through the collector's own code, in-process: the ingest
pump's admit and take (its queues and round robin), and the collector's _receive (decode,
ingest, step log) of one-record steps messages and heartbeats, 1,024 ranks on 64
connections. CPU of this process only, so the box's other load moves it little: for
pairing two trees in one session (issue 42's flood defences must not slow this path).

Usage: python benchmarks/honest_path.py [--rounds R]
  the old code: PYTHONPATH=<a folder with its traceml_tui, and its agent as traceml_agent>
  python benchmarks/honest_path.py  (run from outside the worktree; prints `code`)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import zmq

import traceml_tui
from traceml_agent import protocol
from traceml_agent.protocol import PHASES, Identity
from traceml_tui.collect.collector import Collector
from traceml_tui.collect.ingest_pump import IngestPump
from traceml_tui.judge.state import RunState

RANKS, CONNECTIONS, STEPS = 1024, 64, 20


def pump_round(ctx: zmq.Context) -> float:
    """CPU µs per frame admitted and taken, ~260-byte frames from 64 connections."""
    pump = IngestPump(ctx, ctx.socket(zmq.ROUTER))  # not started: its methods by hand
    rng = random.Random(1)
    routes = [b"c%d" % i for i in range(CONNECTIONS)]
    frames = [[rng.choice(routes), b"x" * 260] for _ in range(200)]
    n = 0
    cpu = time.process_time()
    for _ in range(500):
        pump._admit(frames)
        while got := pump.take(256, 1 << 20):
            n += len(got)
    spent = time.process_time() - cpu
    pump.wake.close()
    pump._pump.close()
    pump.sock.close()
    return spent / n * 1e6


def receive_round() -> float:
    """CPU µs per message through Collector._receive."""
    with tempfile.TemporaryDirectory() as tmp:
        state = RunState("bench", world_size=RANKS, nnodes=RANKS // 8)
        coll = Collector(Path(tmp), state)
        try:
            ids = [Identity(r, r % 8, r // 8, f"node{r // 8:03d}", 1000 + r, RANKS)
                   for r in range(RANKS)]
            conns = [b"c%d" % (r % CONNECTIONS) for r in range(RANKS)]
            for r in range(RANKS):
                coll._receive([conns[r], protocol.encode("hello", ids[r], 0, 1.0)], 1.0)
            record = [5.0, None, 30.0, 50.0, 4.0, 8.0, 3.0][:len(PHASES)]
            frames = [[conns[r], protocol.encode(
                "steps", ids[r], s, 1.0, phases=list(PHASES), records=[[s, 1.0 + s, 100.0,
                                                                        *record]],
                dropped=0, forced=[0] * len(PHASES))]
                for s in range(1, STEPS + 1) for r in range(RANKS)]
            frames += [[conns[r], protocol.encode("heartbeat", ids[r], 100 + s, 1.0, step=s)]
                       for s in range(2) for r in range(RANKS)]
            cpu = time.process_time()
            for f in frames:
                coll._receive(f, 2.0)
            return (time.process_time() - cpu) / len(frames) * 1e6
        finally:
            coll.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    ctx = zmq.Context()
    pump = [pump_round(ctx) for _ in range(a.rounds)]
    recv = [receive_round() for _ in range(a.rounds)]
    print(json.dumps({"code": traceml_tui.__file__,
                      "pump_us_per_frame": round(statistics.median(pump), 3),
                      "receive_us_per_msg": round(statistics.median(recv), 2),
                      "receive_range": [round(min(recv), 2), round(max(recv), 2)]}))


if __name__ == "__main__":
    main()
