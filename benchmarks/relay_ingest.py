"""Node 0's receive path for relay batches, in-process: CPU per rank message, relays that
send every payload as it came against relays that send plain steps as columns
(protocol.StepColumns) and relays that also send heartbeats and sys samples in typed lists
(RelayBatch.beats, .samples: `lists`), paired in one process (alternating rounds, median
of each).

The traffic is soak.py's (the agents' cadence at --ranks, 8 ranks a node, the relays'
tick), batched as the relays batch it, then fed to a real Collector's receive path
(`_receive` per frame, `flush_columns` per drain of 256 frames, as `drain` does). No
sockets, CURVE or ticks: what the columns change, free of the machine's other load
(CPU time of this process only).

Usage: python benchmarks/relay_ingest.py [--ranks N] [--step-ms MS] [--seconds S] [--rounds R]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from collector_ingest import _phase_ms, beat_share, stamp, templates  # noqa: E402

from traceml_agent import protocol  # noqa: E402
from traceml_agent.protocol import (  # noqa: E402
    PHASES,
    RELAY_TAG,
    Identity,
    RelayBatch,
    encode_relay_batch,
)
from traceml_agent.transport import send_interval_s, sys_interval_s  # noqa: E402
from traceml_tui.collect.collector import Collector  # noqa: E402
from traceml_tui.judge.state import RunState  # noqa: E402

try:  # the code before relay columns (PYTHONPATH=its tree) measures payloads only
    from traceml_tui.collect import relay_columns  # noqa: E402
    from traceml_tui.collect.relay import tick_s  # noqa: E402
except ImportError:
    relay_columns = None  # type: ignore[assignment]

    def tick_s(world_size: int) -> float:
        return 0.2

PER_NODE, DRAIN = 8, 256


def traffic(world: int, step_ms: float, seconds: float) -> tuple[list, list]:
    """(setup, ticks): per relay tick, each node's (route, payload) list."""
    nodes = math.ceil(world / PER_NODE)
    rng = random.Random(7)
    interval, sys_every = send_interval_s(world), sys_interval_s(world)
    rate = min(1.0 / interval, 1000.0 / step_ms)
    rpm = max(1, round(interval * 1000.0 / step_ms))
    ids = [Identity(r, r % PER_NODE, r // PER_NODE, f"node{r // PER_NODE:05d}", 100_000 + r,
                    world) for r in range(world)]
    tpl = [templates(i, rpm, rng, False) for i in ids]
    setup: list[list] = [[] for _ in range(nodes)]
    for k, ident in enumerate(ids):
        setup[k // PER_NODE].append((k % PER_NODE, protocol.encode(
            "hello", ident, 0, time.time(), run="bench", device="cuda:0", env={})))
        recs = [[s, time.time(), *_phase_ms(rng, False)] for s in range(32)]
        setup[k // PER_NODE].append((k % PER_NODE, protocol.encode(
            "steps", ident, 1, time.time(), phases=list(PHASES), records=recs, dropped=0)))
    pattern = [(0, k) for _ in range(max(1, round(rate))) for k in range(world)]
    if rate < 1:
        pattern = [(0, k) for k in range(world) if k % round(1 / rate) == 0]
    pattern += [(1, k) for k in range(world) if k % round(sys_every) == 0]
    beats = beat_share(world, rate)  # the agents' heartbeat cadence
    pattern += [(2, k) for k in range(world) if k % beats == 0]
    rng.shuffle(pattern)
    try:  # the relays' own tick: from the world and the ranks on their node
        tick = tick_s(world, PER_NODE)
    except TypeError:  # the code before: from the world alone
        tick = tick_s(world)
    per_tick = round(len(pattern) * tick)
    seq, step = [2] * world, [32] * world
    ticks = []
    for t in range(int(seconds / tick)):
        pending: list[list] = [[] for _ in range(nodes)]
        for j in range(per_tick):
            kind, k = pattern[(t * per_tick + j) % len(pattern)]
            pending[k // PER_NODE].append((k % PER_NODE, bytes(stamp(
                tpl[k][kind], seq[k], time.time(), step[k], rpm))))
            step[k] += rpm if kind == 0 else 0
            seq[k] += 1
        ticks.append(pending)
    return [setup], ticks


def _item(payload: bytes, lists: bool) -> object:
    """A payload as a relay sends it: `lists`, heartbeats and sys samples in typed lists
    (relay_columns.item_of, issue 43); else plain steps as columns only, as before."""
    if lists:
        return relay_columns.item_of(payload)
    m = relay_columns.plain_steps(payload)
    return payload if m is None else (m, payload)


def frames(ticks: list, columns: bool, lists: bool = False) -> list[list[bytes]]:
    out, counts = [], {}
    for pending in ticks:
        for node, items in enumerate(pending):
            if not items:
                continue
            routes = [r for r, _ in items]
            payloads = [p for _, p in items]
            n = counts.get(node, 0)
            counts[node] = n + 1
            if columns:
                batch = relay_columns.relay_batch(node, n, 0, routes,
                                                  [_item(p, lists) for p in payloads])
            else:
                batch = RelayBatch(node, n, 0, routes, payloads)
            out.append([b"relay%d" % node, RELAY_TAG, encode_relay_batch(batch)])
    return out


def run(world: int, setup: list, ticks: list, columns: bool, lists: bool = False
        ) -> tuple[float, int]:
    """CPU seconds of the receive path for the ticks' messages, and their count."""
    state = RunState("bench", world, math.ceil(world / PER_NODE), PER_NODE,
                     started_at=time.time())
    with tempfile.TemporaryDirectory() as tmp:
        coll = Collector(Path(tmp), state)
        try:
            flush = getattr(coll, "flush_columns", lambda: None)
            for f in frames(setup, columns):
                coll._receive(f, time.monotonic())
            flush()
            load = frames(ticks, columns, lists)
            before = state.counters["messages"]
            t0 = time.process_time()
            for j in range(0, len(load), DRAIN):
                mono = time.monotonic()
                for f in load[j:j + DRAIN]:
                    coll._receive(f, mono)
                flush()
            cpu = time.process_time() - t0
            n = state.counters["messages"] - before
            assert state.counters["malformed"] == 0
        finally:
            coll.close()
    return cpu, n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--step-ms", type=float, default=100.0)
    p.add_argument("--seconds", type=float, default=10.0, help="of traffic per round")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    setup, ticks = traffic(a.ranks, a.step_ms, a.seconds)
    us: dict[str, list[float]] = {"payloads": []}
    if relay_columns is not None:
        us["columns"] = []
        if hasattr(relay_columns, "item_of"):  # heartbeats and samples in typed lists
            us["lists"] = []
    for _ in range(a.rounds):
        for mode in us:
            cpu, n = run(a.ranks, setup, ticks, mode != "payloads", mode == "lists")
            us[mode].append(cpu / n * 1e6)
    per_s = sum(len(items) for pending in ticks for items in pending) / a.seconds
    code = Path(sys.modules["traceml_tui"].__file__ or "").parent
    out: dict[str, object] = {"ranks": a.ranks, "messages_per_s": round(per_s),
                              "rounds": a.rounds, "code": str(code)}
    for mode, vals in us.items():
        med = statistics.median(vals)
        out[f"{mode}_us_per_msg"] = round(med, 2)
        out[f"{mode}_core_share"] = round(med * per_s / 1e6, 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
