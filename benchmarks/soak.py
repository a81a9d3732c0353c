"""Soak: a long run of N simulated ranks through real node relays into a real collector.

    python benchmarks/soak.py --ranks 16384 --ranks-per-node 8 --seconds 600

What is real: the `Collector` (its serve() loop, in a child process pinned to core 0,
CURVE on every socket with a run secret), the `Relay` objects of traceml_tui/collect/relay.py
(one per node, each with its own CURVE connection to the collector, batching per tick
exactly as in a run), the wire bytes (protocol.encode, patched per message as in
collector_ingest.py). What is simulated: the ranks, in one process on the other core,
hand their messages to their node's relay in-process (`Relay.add`) instead of over the
relay's loopback socket, which would take one CURVE session per rank on this 2-core
machine; in a real job that leg costs each node's CPU, not node 0's.

Cadence, as the agents of a job this size send (agent/transport.py, read from the code
under test): a steps message per step, at most one per send interval (from a job-wide
budget: 0.1 s up to 512 ranks, 0.2 s at 1,024, 1 s from 5,120; faster steps are
batched), a heartbeat every second (a stepping rank's every 5 s past 1,024 ranks), a sys
sample every second (every 5 s past 1,024 ranks); --step-ms sets the step time (default
1000 ms: jobs of thousands of GPUs step in seconds).

Prints progress every 30 s; the last line is one JSON object: ranks, nodes, kept_up,
collector_cpu_share (of one core), rss_mib_start (the first sample at minute 2, or a
fifth into shorter runs), rss_mib_end, the same two as medians of a minute's samples
(rss_mib_start_median: the minute centred on the mark; rss_mib_end_median: the last
minute; one sample can land on a snapshot's write, a transient, not growth),
rss_mib_every_60s, every_rank_in_summary, and the figures behind them.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec
import psutil
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from collector_ingest import (  # noqa: E402 - the same simulated agent bytes
    COLLECTOR_CORE,
    OTHER_CORES,
    TimedCollector,
    TimedState,
    _phase_ms,
    beat_share,
    pin,
    recv,
    stamp,
    templates,
)

from traceml_agent import keys, protocol  # noqa: E402
from traceml_agent.protocol import PHASES, Identity  # noqa: E402
from traceml_agent.transport import send_interval_s, sys_interval_s  # noqa: E402
from traceml_tui.collect.auth import start_authenticator  # noqa: E402
from traceml_tui.collect.relay import TICK_S, Relay  # noqa: E402

try:  # the code before relay columns has none (run paired with it: PYTHONPATH=old tree)
    from traceml_tui.collect import relay_columns  # noqa: E402
except ImportError:
    relay_columns = None  # type: ignore[assignment]
from traceml_tui.judge.windows import window_steps_for  # noqa: E402
from traceml_tui.runfolder.layout import RunFolder  # noqa: E402

SECRET = "5a" * 32
SAMPLE_S = 10.0
REPORT_S = 30.0


def run_collector(run_dir: str, world: int, nnodes: int, conn: Connection) -> None:
    cores = pin({COLLECTOR_CORE})
    state = TimedState("soak", world, nnodes, world // nnodes, started_at=time.time())
    state.conn = conn
    coll = TimedCollector(Path(run_dir), state, secret=SECRET)
    coll.announce()
    conn.send(("ready", coll.ingest_addr, coll.control_addr, cores))
    try:
        coll.serve()
    finally:
        coll.close()
    conn.send(("done", dict(state.counters)))


CHECKED = 5_000  # simulated steps messages whose relay check is compared with the real one


class Presumed:
    """The relays' check of a simulated steps message (relay_columns.plain_steps) made from
    its template's instead of decoding each message: the same result (compared with the
    real check for the first CHECKED messages), so node 0 receives the same bytes. In a
    job the decode runs on each node's own CPU; here one core simulates 2,048 nodes'
    relays, and it would fall behind the ranks' cadence (as stamping stands in for the
    ranks' own encoding)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.payload: Any = None
        self.plain: Any = None
        self.checked = 0
        self.tails: dict[tuple[int, int], list[list[Any]]] = {}
        self.base: dict[int, Any] = {}

    def make(self, k: int, variants: list[bytes], seq: int, wall: float, step: int,
             rpm: int, payload: bytearray) -> None:
        v = seq % len(variants)
        tails = self.tails.get((k, v))
        if tails is None:
            wire, phases = self.real(variants[v])
            self.base.setdefault(k, (wire, phases))
            tails = self.tails[(k, v)] = [r[2:] for r in wire.records]
        wire, phases = self.base[k]
        recs = [[step + j, wall - 0.001 * (rpm - j), *tail] for j, tail in enumerate(tails)]
        self.payload = payload
        self.plain = (msgspec.structs.replace(wire, seq=seq, t=wall, records=recs), phases)

    def __call__(self, payload: Any) -> Any:
        if payload is not self.payload:
            return self.real(payload)
        if self.checked < CHECKED:
            self.checked += 1
            assert self.real(bytes(payload)) == self.plain, "presumed check differs"
        return self.plain


class PresumedMark:
    """The relays' check of a simulated heartbeat or sys sample (relay_columns.relayed_mark:
    a whole decode, to know it travels in its kind's typed list) taken as its template's
    kind, compared with the real check for the first CHECKED of them: as Presumed, the
    decode each node's relay does on its own CPU, left out of the one core that simulates
    every node."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.payload: Any = None
        self.mark: bytes | None = None
        self.checked = 0

    def expect(self, payload: Any, kind: int) -> None:
        self.payload = payload
        self.mark = protocol.SYS_MARK if kind == 1 else protocol.BEAT_MARK

    def __call__(self, payload: Any) -> Any:
        if payload is not self.payload:
            return self.real(payload)
        if self.checked < CHECKED:
            self.checked += 1
            assert self.real(bytes(payload)) == self.mark, "presumed mark differs"
        return self.mark


def run_ranks(addr: str, world: int, per_node: int, step_ms: float, prefill: int,
              seconds: float, conn: Connection, columns: bool = True) -> None:
    """Every simulated rank, handing its messages to its node's real relay (`columns`
    False: relays that send every payload as it came, as before protocol.StepColumns)."""
    pin(OTHER_CORES)
    presumed = marks = None
    if not columns and relay_columns is not None:
        relay_columns.plain_steps = lambda payload: None
        if hasattr(relay_columns, "relayed_mark"):  # nor heartbeats and samples in lists
            relay_columns.relayed_mark = lambda payload: None
    elif relay_columns is not None:
        presumed = relay_columns.plain_steps = Presumed(relay_columns.plain_steps)
        if hasattr(relay_columns, "relayed_mark"):  # a tree whose relays list them
            marks = relay_columns.relayed_mark = PresumedMark(relay_columns.relayed_mark)
    nodes = math.ceil(world / per_node)
    rng, slow = random.Random(7), world // 3
    # The agents' own cadence at this world size (agent/transport.py): a step batch every
    # `interval` (records of faster steps batched), a heartbeat a second, system samples
    # every `sys_every`.
    interval, sys_every = send_interval_s(world), sys_interval_s(world)
    rate = min(1.0 / interval, 1000.0 / step_ms)  # steps messages a second per rank
    rpm = max(1, round(interval * 1000.0 / step_ms))
    ids = [Identity(r, r % per_node, r // per_node, f"node{r // per_node:05d}", 100_000 + r,
                    world) for r in range(world)]
    tpl = [templates(i, rpm, rng, i.rank == slow) for i in ids]
    ctx = zmq.Context(io_threads=1)
    ctx.set(zmq.MAX_SOCKETS, 2 * nodes + 64)  # libzmq's default is 1,023 per context
    run_keys = keys.derive(SECRET)
    auth = start_authenticator(ctx, run_keys)
    relays = [Relay(ctx, addr, n, run_keys) for n in range(nodes)]
    conns = [r.to_bytes(4, "big") for r in range(world)]
    seq, step = [1] * world, [prefill] * world

    def tick_all(now: float) -> None:
        for relay in relays:
            relay.tick(now)

    for k, ident in enumerate(ids):  # hello and a window's worth of steps, through relays
        relay = relays[k // per_node]
        relay.add(conns[k], protocol.encode("hello", ident, 0, time.time(), run="soak",
                                            device="cuda:0", env={}))
        for s0 in range(0, prefill, 64):
            recs = [[s, time.time(), *_phase_ms(rng, k == slow)]
                    for s in range(s0, min(prefill, s0 + 64))]
            relay.add(conns[k], protocol.encode("steps", ident, seq[k], time.time(),
                                                phases=list(PHASES), records=recs, dropped=0))
            seq[k] += 1
        if k % (per_node * 64) == 0:
            tick_all(float("inf"))
    tick_all(float("inf"))
    conn.send(sum(r.forwarded for r in relays))
    start = recv(conn, 600)
    # One second of traffic, spread evenly: steps at `rate`, then sys and heartbeat.
    pattern = [(0, k) for _ in range(max(1, round(rate))) for k in range(world)]
    if rate < 1:  # slower than a step a second: a steps message from 1 rank in 1/rate
        pattern = [(0, k) for k in range(world) if k % round(1 / rate) == 0]
    sys_share = round(sys_every)  # a sys sample from one rank in `sys_share` each second
    pattern += [(1, k) for k in range(world) if k % sys_share == 0]
    beats = beat_share(world, rate)  # the agents' heartbeat cadence
    pattern += [(2, k) for k in range(world) if k % beats == 0]
    rng.shuffle(pattern)
    per_s, total = len(pattern), int(len(pattern) * seconds)
    # The relays' own tick, as they set it from their ranks' messages (before it
    # scaled: TICK_S).
    tick = getattr(relays[0], "tick_s", TICK_S)
    i, next_tick, behind = 0, start + tick, 0.0
    time.sleep(max(0.0, start - time.monotonic()))
    while i < total and time.monotonic() < start + seconds + 30:
        now = time.monotonic()
        due = min(total, int((now - start) * per_s))
        behind = max(behind, (due - i) / per_s)
        wall = time.time()
        while i < due:
            kind, k = pattern[i % per_s]
            payload = stamp(tpl[k][kind], seq[k], wall, step[k], rpm)
            if presumed is not None and kind == 0:
                presumed.make(k, tpl[k][0][0], seq[k], wall, step[k], rpm, payload)
            elif marks is not None and kind != 0:
                marks.expect(payload, kind)
            relays[k // per_node].add(conns[k], payload)
            step[k] += rpm if kind == 0 else 0
            seq[k], i = seq[k] + 1, i + 1
        if now >= next_tick:
            tick_all(now)
            next_tick = now + tick
        time.sleep(0.005)
    tick_all(float("inf"))
    conn.send({"checked": 0 if presumed is None else presumed.checked,
               "marks_checked": 0 if marks is None else marks.checked,
               "sent": sum(r.forwarded for r in relays), "generated": i, "target": total,
               "relay_dropped": sum(r.dropped for r in relays), "behind_s": behind,
               "batches": sum(r.batches for r in relays)})
    if conn.poll(600):  # keep the connections while the collector drains and finishes
        conn.recv()
    for relay in relays:
        relay.close()
    auth.stop()
    ctx.term()


def _finish(control: str) -> bool:
    ctx = zmq.Context()
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    keys.secure_client(req, keys.derive(SECRET))
    req.connect(control)
    req.send_json({"op": "finish", "grace_s": 0.5, "exit_code": 0})
    ok = bool(req.poll(300_000) and req.recv_json().get("path"))
    req.close()
    ctx.term()
    return ok


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=16384)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--step-ms", type=float, default=1000.0)
    p.add_argument("--no-columns", action="store_true",
                   help="relays send every payload as it came (no protocol.StepColumns)")
    a = p.parse_args()
    pin(OTHER_CORES)
    nodes = math.ceil(a.ranks / a.ranks_per_node)
    need_fds = 8 * nodes + 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need_fds:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, need_fds), hard))
    ctx, run_dir = mp.get_context("spawn"), tempfile.mkdtemp(prefix="traceml-soak-")
    prefill = window_steps_for(a.ranks)
    print(f"soak: {a.ranks} ranks on {nodes} nodes ({a.ranks_per_node} per node, one relay "
          f"each), step {a.step_ms:g} ms, {a.seconds:g} s, windows prefilled with {prefill} "
          f"steps; collector on core {COLLECTOR_CORE}", flush=True)
    cconn, c2 = ctx.Pipe()
    cproc = ctx.Process(target=run_collector, args=(run_dir, a.ranks, nodes, c2), daemon=True)
    cproc.start()
    _, ingest, control, _ = recv(cconn, 60)
    ev: list[tuple] = []

    def pump(until: float) -> None:
        while time.monotonic() < until:
            if cconn.poll(min(0.05, max(0.0, until - time.monotonic()))):
                ev.append(cconn.recv())

    def counted() -> int:
        return max((e[2] for e in ev if e[0] in ("cnt", "eval")), default=0)

    gconn, g2 = ctx.Pipe()
    gproc = ctx.Process(target=run_ranks, daemon=True, args=(
        ingest, a.ranks, a.ranks_per_node, a.step_ms, prefill, a.seconds, g2,
        not a.no_columns))
    gproc.start()

    def from_ranks() -> Any:
        while not gconn.poll(0.05):
            if not gproc.is_alive():
                raise SystemExit("soak: the simulated ranks' process died (see above)")
            pump(time.monotonic() + 0.05)
        return gconn.recv()

    base = from_ranks()
    deadline = time.monotonic() + 600
    while counted() < base and time.monotonic() < deadline:
        pump(time.monotonic() + 0.5)
    print(f"setup: {base:,} hello/prefill messages ingested", flush=True)
    cp = psutil.Process(cproc.pid)
    start = time.monotonic() + 0.5
    gconn.send(start)
    pump(start)
    cpu0 = cp.cpu_times()
    samples: list[tuple[float, float, float]] = []  # (s, rss MiB, cpu s)
    next_report = start + REPORT_S
    while time.monotonic() < start + a.seconds:
        pump(min(start + a.seconds, time.monotonic() + SAMPLE_S))
        t = cp.cpu_times()
        samples.append((time.monotonic() - start, cp.memory_info().rss / 2**20,
                        t.user + t.system - cpu0.user - cpu0.system))
        if time.monotonic() >= next_report:
            s, rss, cpu = samples[-1]
            print(f"  {s:5.0f} s: collector CPU {100 * cpu / s:4.1f}% of a core, RSS "
                  f"{rss:6.1f} MiB, messages ingested {counted() - base:,}", flush=True)
            next_report += REPORT_S
    wall = samples[-1][0]
    cpu_s = samples[-1][2]
    gen = from_ranks()
    gen["sent"] -= base  # the relays' count includes the hello/prefill messages
    drain_until = time.monotonic() + 60
    while counted() < base + gen["sent"] and time.monotonic() < drain_until:
        pump(time.monotonic() + 0.2)
    drained_s = time.monotonic() - (start + a.seconds)
    finish_ok = _finish(control)
    while not ev or ev[-1][0] != "done":
        ev.append(recv(cconn, 120))
    counters = ev[-1][1]
    gconn.send("quit")
    for proc in (gproc, cproc):
        proc.join(20)
        if proc.is_alive():
            proc.terminate()
    doc = json.loads(RunFolder(Path(run_dir)).summary_json.read_text())
    shutil.rmtree(run_dir, ignore_errors=True)
    mark = min(120.0, a.seconds / 5)
    rss_start = next((r for s, r, _ in samples if s >= mark), samples[0][1])
    span = min(30.0, mark / 2)
    around = [r for s, r, _ in samples if mark - span <= s <= mark + span] or [rss_start]
    last = [r for s, r, _ in samples if s >= wall - 2 * span] or [samples[-1][1]]
    every_60 = [round(next(r for s, r, _ in samples if s >= m), 1)
                for m in range(60, int(wall) + 1, 60)]
    evals = [e[4] for e in ev if e[0] == "eval"]
    lives = [e[2] for e in ev if e[0] == "live"]
    in_summary = sum(1 for r in doc["ranks"] if r["steps"] > 0)
    result = {
        "ranks": a.ranks, "nodes": nodes, "step_ms": a.step_ms, "seconds": a.seconds,
        "kept_up": bool(counters["messages"] == base + gen["sent"] and gen["relay_dropped"] == 0
                        and (doc.get("relays") or {}).get("lost_batches") == 0
                        and gen["behind_s"] < 2.0 and drained_s < 10.0),
        "collector_cpu_share": round(cpu_s / wall, 3),
        "rss_mib_start": round(rss_start, 1), "rss_mib_end": round(samples[-1][1], 1),
        "rss_minute_mark_s": mark,
        "rss_mib_start_median": round(statistics.median(around), 1),
        "rss_mib_end_median": round(statistics.median(last), 1),
        "rss_growth_pct_medians": round(
            100 * (statistics.median(last) / statistics.median(around) - 1), 1),
        "rss_mib_every_60s": every_60,
        "every_rank_in_summary": in_summary == a.ranks, "ranks_in_summary": in_summary,
        "messages_offered_per_s": round(gen["sent"] / a.seconds),
        "relay_batches_per_s": round(gen["batches"] / a.seconds),
        "messages_ingested": counters["messages"] - base, "messages_sent": gen["sent"],
        "relay_dropped": gen["relay_dropped"], "ranks_behind_s": round(gen["behind_s"], 2),
        "drained_s_after_load": round(max(0.0, drained_s), 2), "finish_ok": finish_ok,
        "evaluate_ms_median": round(statistics.median(evals), 1) if evals else None,
        "live_write_ms_median": round(statistics.median(lives), 1) if lives else None,
        "malformed": counters["malformed"],
        "relay_columns": relay_columns is not None and not a.no_columns,
        "relay_checks_compared": gen.get("checked", 0),
        "relay_marks_compared": gen.get("marks_checked", 0),
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
