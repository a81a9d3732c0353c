"""Ordinary steps messages sent directly (no node relay), in-process: CPU per message
through the collector's receive path, each message through the per-message path
(decode, StepRecords, ingest record by record) against the drain's columns
(collect/steps_columns.DrainRows: a message's row taken at once, its records joined with
the drain's others and checked and ingested at the flush). Alternating rounds in one
process, median of each (CPU time of this process: the box's other load moves it little).

The traffic is collector_ingest.py's at 1,024 ranks: a one-record steps message a rank
per 0.1 s, a heartbeat and a sys sample a second, fed as the drain takes them (`_receive`
per frame, `flush_columns` per 256 frames).

Usage: python benchmarks/direct_steps.py [--ranks N] [--seconds S] [--rounds R]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from collector_ingest import _phase_ms  # noqa: E402

from traceml_agent import protocol  # noqa: E402
from traceml_agent.protocol import PHASES, Identity  # noqa: E402
from traceml_tui.collect import steps_columns  # noqa: E402
from traceml_tui.collect.collector import Collector  # noqa: E402
from traceml_tui.judge.state import RunState  # noqa: E402

CONNECTIONS, DRAIN = 64, 256


def traffic(ranks: int, seconds: float) -> tuple[list, list]:
    rng = random.Random(5)
    ids = [Identity(r, r % 8, r // 8, f"node{r // 8:04d}", 1000 + r, ranks) for r in range(ranks)]
    conns = [b"c%d" % (r % CONNECTIONS) for r in range(ranks)]
    setup = []
    for r in range(ranks):
        setup.append([conns[r], protocol.encode("hello", ids[r], 0, time.time(), run="bench")])
        setup.append([conns[r], protocol.encode(
            "steps", ids[r], 1, time.time(), phases=list(PHASES), dropped=0,
            records=[[s, time.time(), *_phase_ms(rng, False)] for s in range(32)])])
    load, seq = [], [2] * ranks
    for tenth in range(int(seconds * 10)):
        tick = []
        for r in range(ranks):
            step = 32 + tenth
            tick.append([conns[r], protocol.encode(
                "steps", ids[r], seq[r], time.time(), phases=list(PHASES), dropped=0,
                records=[[step, time.time(), *_phase_ms(rng, False)]])])
            seq[r] += 1
            if tenth % 10 == r % 10:
                tick.append([conns[r], protocol.encode("heartbeat", ids[r], seq[r], time.time(),
                                                       step=step)])
                tick.append([conns[r], protocol.encode("sys", ids[r], seq[r] + 1, time.time(),
                                                       cpu_pct=50.0)])
                seq[r] += 2
        rng.shuffle(tick)
        load += tick
    return setup, load


def run(ranks: int, setup: list, load: list, rows: bool) -> tuple[float, int]:
    steps_columns.SMALL_AS_ROWS = rows
    state = RunState("bench", ranks, ranks // 8, 8, started_at=time.time())
    with tempfile.TemporaryDirectory() as tmp:
        coll = Collector(Path(tmp), state)
        try:
            for f in setup:
                coll._receive(f, time.monotonic())
            coll.flush_columns()
            before = state.counters["messages"]
            t0 = time.process_time()
            for j in range(0, len(load), DRAIN):
                mono = time.monotonic()
                for f in load[j:j + DRAIN]:
                    coll._receive(f, mono)
                coll.flush_columns()
            cpu = time.process_time() - t0
            n = state.counters["messages"] - before
            assert state.counters["malformed"] == 0 and n == len(load), state.counters
            steps = sum(rs.steps for rs in state.ranks.values())
        finally:
            coll.close()
    return cpu / n * 1e6, steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--seconds", type=float, default=5.0, help="of traffic per round")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    setup, load = traffic(a.ranks, a.seconds)
    us: dict[str, list[float]] = {"messages": [], "drain_rows": []}
    steps: dict[str, int] = {}
    for _ in range(a.rounds):
        for mode in us:
            cost, steps[mode] = run(a.ranks, setup, load, mode == "drain_rows")
            us[mode].append(cost)
    assert steps["messages"] == steps["drain_rows"], steps
    per_s = len(load) / a.seconds
    out: dict[str, object] = {"ranks": a.ranks, "messages_per_s": round(per_s),
                              "rounds": a.rounds}
    for mode, vals in us.items():
        out[f"{mode}_us_per_msg"] = round(statistics.median(vals), 2)
        out[f"{mode}_range"] = [round(min(vals), 2), round(max(vals), 2)]
        out[f"{mode}_core_share"] = round(statistics.median(vals) * per_s / 1e6, 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
