"""Collector ingest benchmark: can one collector core keep up with N ranks x R messages/s?

A real `Collector` runs its real serve() loop (drain; evaluate() every 0.5 s; write_live()
every 2 s into a temp run dir) in a child process pinned to core 0, timed by subclassing.
One generator process (other cores) simulates all N ranks over CONNECTIONS (64) DEALER
sockets to tcp://127.0.0.1 (the collector places messages by their 'id' field; its ingest
pump keeps one queue per connection, and real agents have a connection each).
Per rank: 'hello', a prefill of window_steps_for(N) steps (so ticks run at their
steady-state cost; --no-prefill to skip), then --rate 'steps' msgs/s of --records-per-msg
records (default: the agents' own rate at N ranks, agent/transport.send_interval_s) PLUS
the agents' 'sys' and 'heartbeat' (1 a second each up to 1,024 ranks; --no-sys-hb: none).
Payloads: protocol.encode() per rank, 16 jittered variants, then seq/t/step/t_end patched in
place (uint64/float64 slots: valid msgpack); steps increase per rank, so no duplicates.
Usage: python benchmarks/collector_ingest.py [--sweep] [--ranks N] [--seconds S] ...
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import random
import shutil
import statistics
import struct
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psutil
import zmq

from traceml_agent import protocol
from traceml_agent.protocol import PHASES, Identity
from traceml_agent.transport import send_interval_s, sys_interval_s

try:  # agents that beat every 5 s while stepping, past 1,024 ranks
    from traceml_agent.transport import stepping_beat_s
except ImportError:  # the code before: every second (old trees on PYTHONPATH)
    def stepping_beat_s(world_size: int) -> float:
        return 1.0

from traceml_tui.collect.collector import DRAIN_BATCH, Collector
from traceml_tui.judge.state import RunState
from traceml_tui.judge.windows import window_steps_for
from traceml_tui.runfolder.layout import RunFolder


def beat_share(world_size: int, batches_per_s: float) -> int:
    """Heartbeats in a second of simulated traffic come from one rank in this many: a
    stepping rank's cadence (agent/transport.stepping_beat_s: every second up to 1,024
    ranks, every 5 s past it); a rank slower than a batch a second beats at the turns
    without one, taken as every turn."""
    return round(stepping_beat_s(world_size)) if batches_per_s >= 1 else 1


U64, F64 = struct.Struct(">Q"), struct.Struct(">d")
SEQ_S, STEP_S, HB_S = 0x2AAA_0000_0000_0001, 0x2BBB_0000_0000_0000, 0x2CCC_0000_0000_0001
T_S, T_END_S = 3.0e10 + 0.25, 4.0e10 + 0.5  # float sentinels (t_end: + record index)
VARIANTS, COLLECTOR_CORE, BATCH, PREFILL_BATCH = 16, 0, 2_000, 64
OTHER_CORES = set(range(os.cpu_count() or 1)) - {COLLECTOR_CORE}
BASE_MS = (6.0, 1.5, 30.0, 50.0, 8.0, 4.0)  # dataloader h2d forward backward sync optimizer


def pin(cores: set[int]) -> str:
    """Pin the calling thread (and the threads it starts later); say where it may run."""
    if not hasattr(os, "sched_setaffinity"):
        return "unpinned"
    with contextlib.suppress(OSError):  # a core outside this cpuset: keep the mask
        os.sched_setaffinity(0, cores or os.sched_getaffinity(0))
    return ",".join(map(str, sorted(os.sched_getaffinity(0))))


def recv(conn: Connection, timeout: float) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"no message within {timeout} s")
    return conn.recv()


# --- collector child: the real serve() loop, timed by overriding (not editing) ----------

class TimedState(RunState):
    conn: Connection

    def evaluate(self, now: float, mono_now: float | None = None) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        shown = super().evaluate(now, mono_now)
        c = self.counters
        self.conn.send(("eval", time.monotonic(), c["messages"], c["records"],
                        (time.perf_counter() - t0) * 1e3, (time.thread_time() - c0) * 1e3))
        return shown


class TimedCollector(Collector):
    last_cnt = 0.0

    def drain(self, limit: int = DRAIN_BATCH) -> int:
        n = super().drain(limit)
        now = time.monotonic()
        if n and now - self.last_cnt >= 0.1:  # ingest progress, at most 10 samples a second
            self.last_cnt = now
            c = self.state.counters
            self.state.conn.send(("cnt", now, c["messages"], c["records"]))
        return n

    def write_live(self) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        super().write_live()
        self.state.conn.send(("live", time.monotonic(), (time.perf_counter() - t0) * 1e3,
                              (time.thread_time() - c0) * 1e3))


def run_collector(run_dir: str, world: int, conn: Connection) -> None:
    cores = pin({COLLECTOR_CORE})  # before zmq starts its I/O thread: it inherits the mask
    state = TimedState("bench", world, started_at=time.time())
    state.conn = conn
    coll = TimedCollector(Path(run_dir), state)
    coll.announce()
    conn.send(("ready", coll.ingest_addr, coll.control_addr, cores))
    try:
        coll.serve()
    finally:
        coll.close()
    conn.send(("done", dict(state.counters)))


# --- load generator ---------------------------------------------------------------------

def _at(buf: bytes, marker: bytes) -> int:
    at = buf.find(marker)
    assert at >= 0 and buf.find(marker, at + 1) < 0, "sentinel not unique"
    return at + 1


def _phase_ms(rng: random.Random, slow: bool) -> list[float]:
    ph = [v * rng.uniform(0.85, 1.15) for v in BASE_MS]
    ph[0] += 40.0 if slow else 0.0  # one input straggler: exercises the diagnosis
    step_ms = sum(ph) + rng.uniform(1.0, 4.0)
    return [step_ms, *ph, step_ms - sum(ph)]


def templates(ident: Identity, rpm: int, rng: random.Random, slow: bool) -> list[tuple]:
    """Per kind (steps, sys, heartbeat): (variants, seq offset, t offset, record offsets,
    heartbeat step offset)."""
    q, f = b"\xcf" + U64.pack(SEQ_S), b"\xcb" + F64.pack(T_S)
    steps = [protocol.encode("steps", ident, SEQ_S, T_S, phases=list(PHASES), dropped=0,
                             records=[[STEP_S + i, T_END_S + i, *_phase_ms(rng, slow)]
                                      for i in range(rpm)]) for _ in range(VARIANTS)]
    assert len({_at(s, q) for s in steps}) == 1  # all variants share the offsets
    recs = [(_at(steps[0], b"\xcf" + U64.pack(STEP_S + i)),
             _at(steps[0], b"\xcb" + F64.pack(T_END_S + i))) for i in range(rpm)]
    sys_ = protocol.encode("sys", ident, SEQ_S, T_S, cpu_pct=101.5, rss_mb=3512.0,
                           gpu_util=97.0, gpu_mem_mb=61234.0, gpu_mem_total_mb=81559.0)
    hb = protocol.encode("heartbeat", ident, SEQ_S, T_S, step=HB_S, phase="forward",
                         in_phase_s=0.01)
    return [(steps, _at(steps[0], q), _at(steps[0], f), recs, 0),
            ([sys_], _at(sys_, q), _at(sys_, f), [], 0),
            ([hb], _at(hb, q), _at(hb, f), [], _at(hb, b"\xcf" + U64.pack(HB_S)))]


def stamp(template: tuple, seq: int, wall: float, step: int, rpm: int) -> bytearray:
    """One simulated agent message: a pre-encoded template with its sequence number, clock
    and step numbers patched in place (encoding each message would cost the simulated
    agents more CPU than the collector under test)."""
    variants, o_seq, o_t, recs, o_hb = template
    b = bytearray(variants[seq % len(variants)])
    U64.pack_into(b, o_seq, seq)
    F64.pack_into(b, o_t, wall)
    for j, (o_step, o_end) in enumerate(recs):
        U64.pack_into(b, o_step, step + j)
        F64.pack_into(b, o_end, wall - 0.001 * (rpm - j))
    if o_hb:
        U64.pack_into(b, o_hb, step)
    return b


CONNECTIONS = 64


def run_generator(addr: str, world: int, rate: int, rpm: int, sys_hb: bool, prefill: int,
                  seconds: float, conn: Connection) -> None:
    pin(OTHER_CORES)
    rng, slow = random.Random(1234), world // 3
    ids = [Identity(r, r % 8, r // 8, f"node{r // 8:04d}", 100_000 + r, world)
           for r in range(world)]
    tpl = [templates(i, rpm, rng, i.rank == slow) for i in ids]
    ctx = zmq.Context()
    socks = []
    for _ in range(min(world, CONNECTIONS)):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.SNDHWM, 500_000)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(addr)
        socks.append(sock)
    seq, step, pre = [1] * world, [prefill] * world, world
    for k, ident in enumerate(ids):
        sock = socks[k % len(socks)]
        sock.send(protocol.encode("hello", ident, 0, time.time(), run="bench",
                                  device="cuda:0", backend="nccl", env={}))
        for s0 in range(0, prefill, PREFILL_BATCH):  # fill the window: steady-state ticks
            recs = [[s, time.time(), *_phase_ms(rng, k == slow)]
                    for s in range(s0, min(prefill, s0 + PREFILL_BATCH))]
            sock.send(protocol.encode("steps", ident, seq[k], time.time(),
                                      phases=list(PHASES), records=recs, dropped=0))
            seq[k], pre = seq[k] + 1, pre + 1
    # One second of traffic: `rate` rounds of steps, sys after round 0, heartbeat mid-way,
    # each from one rank in so many a second as agents of this world size send them
    # (agent/transport.py: every second up to 1,024 ranks; past it every 5 s, a stepping
    # rank's heartbeat too).
    sys_share, beat_share = round(sys_interval_s(world)), round(stepping_beat_s(world))
    pattern: list[tuple[int, int]] = []
    for rnd in range(rate):
        pattern += [(0, k) for k in range(world)]
        pattern += [(1, k) for k in range(world) if sys_hb and rnd == 0 and k % sys_share == 0]
        pattern += [(2, k) for k in range(world)
                    if sys_hb and rnd == rate // 2 and k % beat_share == 0]
    b = bytearray(tpl[0][0][0][0])  # self-check: patched bytes decode as intended
    for off, value in ((tpl[0][0][1], 7), (tpl[0][0][3][0][0], 5)):
        U64.pack_into(b, off, value)
    assert protocol.decode(bytes(b)).records[0].step == 5
    conn.send(pre)
    start = recv(conn, 300)
    time.sleep(max(0.0, start - time.monotonic()))
    per_s, total = len(pattern), int(len(pattern) * seconds)
    i = sent = dropped = steps_sent = 0
    while i < total and time.monotonic() < start + seconds + 5:  # bounded if we fall behind
        due = min(total, int((time.monotonic() - start) * per_s), i + BATCH)
        if i >= due:
            time.sleep(0.001)
            continue
        wall = time.time()
        while i < due:
            kind, k = pattern[i % per_s]
            b = stamp(tpl[k][kind], seq[k], wall, step[k], rpm)
            step[k] += rpm if kind == 0 else 0
            seq[k], i = seq[k] + 1, i + 1
            try:
                # As agents do: never block, count what is dropped.
                socks[k % len(socks)].send(b, zmq.NOBLOCK)
                sent, steps_sent = sent + 1, steps_sent + (kind == 0)
            except zmq.Again:
                dropped += 1
    conn.send({"sent": sent, "dropped": dropped, "records": steps_sent * rpm, "target": total,
               "elapsed": time.monotonic() - start})
    if conn.poll(300):  # keep the socket open while the collector drains
        conn.recv()
    for sock in socks:
        sock.close()
    ctx.term()


# --- orchestration ----------------------------------------------------------------------

def _slope(pts: list[tuple], col: int) -> float:
    if len(pts) < 3:
        return 0.0
    return statistics.linear_regression([p[1] for p in pts], [p[col] for p in pts]).slope


def _busy(t0: Any, t1: Any) -> float:
    return t1.user + t1.system - t0.user - t0.system


def trial(a: argparse.Namespace, rate: int, seconds: float) -> dict[str, Any]:
    ctx, run_dir = mp.get_context("spawn"), tempfile.mkdtemp(prefix="traceml-bench-")
    prefill = 0 if a.no_prefill else window_steps_for(a.ranks)
    cconn, c2 = ctx.Pipe()
    cproc = ctx.Process(target=run_collector, args=(run_dir, a.ranks, c2), daemon=True)
    cproc.start()
    _, ingest, control, ccores = recv(cconn, 60)
    ev: list[tuple] = []

    def pump(until: float, upto: int | None = None) -> None:  # collect the child's samples
        while time.monotonic() < until:
            if cconn.poll(min(0.05, max(0.0, until - time.monotonic()))):
                ev.append(cconn.recv())
                if upto is not None and ev[-1][0] in ("cnt", "eval") and ev[-1][2] >= upto:
                    return

    def wait(conn: Connection) -> Any:  # a reply from the generator, pumping meanwhile
        while not conn.poll(0.05):
            pump(time.monotonic() + 0.05)
        return conn.recv()

    gconn, g2 = ctx.Pipe()
    gproc = ctx.Process(target=run_generator, daemon=True, args=(
        ingest, a.ranks, rate, a.records_per_msg, not a.no_sys_hb, prefill, seconds, g2))
    gproc.start()
    base = wait(gconn)
    pump(time.monotonic() + 300, upto=base)  # hellos and prefill ingested
    pump(time.monotonic() + 2.5)  # let one write_live pass at the prefilled size
    cp, gp = psutil.Process(cproc.pid), psutil.Process(gproc.pid)
    rss0, start = cp.memory_info().rss, time.monotonic() + 0.2
    gconn.send(start)
    pump(start)
    core0, cpu0, g0, w0 = (psutil.cpu_times(percpu=True)[COLLECTOR_CORE], cp.cpu_times(),
                           gp.cpu_times(), time.monotonic())
    pump(start + seconds)
    core1, cpu1, g1, w1 = (psutil.cpu_times(percpu=True)[COLLECTOR_CORE], cp.cpu_times(),
                           gp.cpu_times(), time.monotonic())
    rss1, gs = cp.memory_info().rss, wait(gconn)
    pump(time.monotonic() + 60, upto=base + gs["sent"])  # bounded wait for the backlog
    t_all = max((e[1] for e in ev if e[0] in ("cnt", "eval")), default=w1)
    zc = zmq.Context()
    req = zc.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(control)
    req.send_json({"op": "finish", "grace_s": 0.2, "exit_code": 0})
    finish_ok = bool(req.poll(60_000) and req.recv_json().get("ok"))
    req.close()
    zc.term()
    while not ev or ev[-1][0] != "done":
        ev.append(recv(cconn, 60))
    counters = ev[-1][1]
    gconn.send("quit")
    for p in (gproc, cproc):
        p.join(10)
        if p.is_alive():
            p.terminate()
    summary = json.loads(RunFolder(Path(run_dir)).summary_json.read_text())
    shutil.rmtree(run_dir, ignore_errors=True)
    offered = gs["sent"] / gs["elapsed"]
    pts = [e for e in ev if e[0] in ("cnt", "eval") and w0 + 1.0 <= e[1] <= w1]
    backlog = [max(0.0, base + offered * (e[1] - start) - e[2]) for e in pts] or [0.0]
    ingested, drain_s = _slope(pts, 2), max(0.0, t_all - w1)
    evals = [e[4:] for e in ev if e[0] == "eval" and w0 <= e[1] <= w1]
    lives = [e[2:] for e in ev if e[0] == "live" and w0 <= e[1] <= w1]
    cpu_s = _busy(cpu0, cpu1)
    tick_s = sum(x[1] for x in evals + lives) / 1e3
    done = [e[2] for e in ev if e[0] in ("cnt", "eval") and w0 <= e[1] <= w1]
    idle = (core1.idle + core1.iowait) - (core0.idle + core0.iowait)
    return {
        "ranks": a.ranks, "rate": rate, "ccores": ccores, "extra": not a.no_sys_hb,
        "prefill": prefill, "seconds": seconds,
        "target": gs["target"] / seconds, "offered": offered, "ingested": ingested,
        "offered_rec": gs["records"] / gs["elapsed"], "ingested_rec": _slope(pts, 3),
        "sent": gs["sent"], "base": base, "dropped": gs["dropped"], "counters": counters,
        "summary_ok": summary["collector"] == counters, "finish_ok": finish_ok,
        "backlog_max": max(backlog), "backlog_end": backlog[-1], "drain_s": drain_s,
        "cpu": 100 * cpu_s / (w1 - w0), "gen_cpu": 100 * _busy(g0, g1) / (w1 - w0),
        "core_busy": 100 * (1 - idle / (sum(core1) - sum(core0))),
        "us_per_msg": 1e6 * (cpu_s - tick_s) / max(1, done[-1] - done[0]) if done else 0.0,
        "tick_pct": 100 * tick_s / (w1 - w0), "rss0": rss0 / 2**20, "rss1": rss1 / 2**20,
        "eval": evals, "live": lives,
        "kept_up": (gs["dropped"] == 0 and counters["messages"] == base + gs["sent"]
                    and ingested >= 0.97 * offered and drain_s <= 2.5),
    }


def _ms(xs: list[tuple[float, float]]) -> str:
    if not xs:
        return "n/a"
    w, c = [x[0] for x in xs], [x[1] for x in xs]
    return (f"n={len(xs)}  wall median {statistics.median(w):.1f} ms, max {max(w):.1f} ms;"
            f"  CPU median {statistics.median(c):.1f} ms, max {max(c):.1f} ms")


def report(r: dict[str, Any]) -> None:
    off = max(r["offered"], 1e-9)
    print(f"--- {r['ranks']} ranks x {r['rate']} steps msgs/s{' (+sys/hb)' * r['extra']} for "
          f"{r['seconds']:.0f} s;"
          f" target {r['target']:,.0f} msgs/s; windows prefilled with {r['prefill']} steps/rank")
    print(f"offered : {r['offered']:9,.0f} msgs/s {r['offered_rec']:9,.0f} records/s  (sent "
          f"{r['sent']:,} + {r['base']:,} hello/prefill; send drops {r['dropped']}; "
          f"generator CPU {r['gen_cpu']:.0f}%)")
    print(f"ingested: {r['ingested']:9,.0f} msgs/s {r['ingested_rec']:9,.0f} records/s  "
          f"(slope of RunState counters over the window)")
    print(f"counters: {r['counters']} (= final_summary.json: {r['summary_ok']})")
    print(f"backlog : max {r['backlog_max']:,.0f} msgs ({r['backlog_max'] / off:.2f} s), end "
          f"{r['backlog_end']:,.0f} msgs ({r['backlog_end'] / off:.2f} s); all ingested "
          f"{r['drain_s']:.2f} s after the load stopped; finish ok {r['finish_ok']}")
    print(f"collector: CPU {r['cpu']:.1f}% of one core (core {r['ccores']} busy "
          f"{r['core_busy']:.0f}% incl. other processes); ticks {r['tick_pct']:.0f}% of a core,"
          f" rest {r['us_per_msg']:.1f} us CPU/msg (recv+decode+ingest+zmq I/O); "
          f"RSS {r['rss0']:.1f} -> {r['rss1']:.1f} MiB")
    print(f"evaluate()  : {_ms(r['eval'])}\nwrite_live(): {_ms(r['live'])}")
    print(f"KEPT UP: {'yes' if r['kept_up'] else 'NO'}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--rate", type=int, default=None,
                   help="steps messages/s per rank (default: the agents' own at --ranks, "
                        "agent/transport.send_interval_s: 10 up to 512 ranks, 5 at 1,024)")
    p.add_argument("--records-per-msg", type=int, default=1)
    p.add_argument("--no-sys-hb", action="store_true", help="no sys+heartbeat (1/s each)")
    p.add_argument("--no-prefill", action="store_true", help="start with empty windows")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--sweep", action="store_true", help="raise --rate until it falls behind")
    p.add_argument("--sweep-rates", default="10,12,14,16,20,30,40")
    a = p.parse_args()
    if a.rate is None:
        a.rate = max(1, round(1.0 / send_interval_s(a.ranks)))
    here = pin(OTHER_CORES)
    print(f"cores: {os.cpu_count()}; collector on core {COLLECTOR_CORE}, load generator and "
          f"this process on {here}; records/msg {a.records_per_msg}; sys+heartbeat: "
          f"{not a.no_sys_hb}", flush=True)
    rates = [int(x) for x in a.sweep_rates.split(",")][:12] if a.sweep else [a.rate]
    best = None
    for rate in rates:
        r = trial(a, rate, a.seconds)
        report(r)
        if not r["kept_up"]:
            print(f"FELL BEHIND at {rate} steps msgs/s per rank: ingested {r['ingested']:,.0f} "
                  f"msgs/s, {r['ingested_rec']:,.0f} records/s at {r['cpu']:.0f}% CPU")
            break
        best = r
    if a.sweep and best:
        print(f"MAX SUSTAINED (rates tried): {best['ranks']} ranks x {best['rate']} steps msgs/s"
              f" = {best['offered']:,.0f} msgs/s, {best['offered_rec']:,.0f} records/s, "
              f"CPU {best['cpu']:.0f}%")


if __name__ == "__main__":
    main()
