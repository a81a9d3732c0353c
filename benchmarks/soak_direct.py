"""Soak, direct: N simulated ranks, each with its own connection (no relays: one node, or
--no-relay), against a real collector process for minutes. Does ingest keep
up the whole time, and does the collector's memory stay flat once warm?

A real `python -m traceml_tui.collect.collector` (plain loopback mode, as `traceml run` starts it)
takes the traffic of --ranks simulated agents from --senders processes. Each rank has its
own DEALER connection (as real agents do; --conns to share fewer) and sends what an agent
sends: one hello, then --rate steps batches a second (--records-per-msg records each) plus
one sys sample and one heartbeat a second, with NOBLOCK sends that drop and count when
the socket is full. Payloads are built the way benchmarks/collector_ingest.py builds them
(protocol.encode per rank, then seq/t/step/t_end patched in place), so steps increase per
rank and nothing is a duplicate. With 2+ cores the collector is pinned to one core and the
senders to the rest (--no-pin: not), so the load generator does not starve the collector.

Every --interval seconds it prints: seconds elapsed, messages sent (and dropped at the
sender), messages ingested (the collector's counters, from the live_snapshot.json it
writes every ~2 s: reading it costs the collector nothing), the lag (messages sent by the
time of that snapshot but not yet ingested, also in seconds of traffic), the collector's
RSS and CPU % (psutil). At the end: a table, the exact totals from final_summary.json,
the dashboard frame time on the collector's last RunView, and two verdicts.

Bounded in time (--seconds, then bounded waits) and in memory: a collector that falls
behind queues the backlog in its own memory (several KiB per queued message), so the
load stops early, and the run fails, once its RSS passes --max-rss-mib.

    python benchmarks/soak_direct.py               # 4096 ranks, 600 s
    python benchmarks/soak_direct.py --ranks 1024 --seconds 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from bisect import bisect_left
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import msgpack
import psutil
import zmq
from collector_ingest import stamp, templates

from traceml_agent import protocol
from traceml_agent.protocol import Identity
from traceml_tui.judge.windows import window_steps_for
from traceml_tui.runfolder.layout import RunFolder

SEND_HWM = 2_000  # per rank, as agent/transport.py
SEND_CHUNK = 2_000  # sends between two looks at the clock
PUBLISH_S = 0.05  # how often a sender publishes its counts
HISTORY_S = 0.1  # how often the main process records the senders' counts
MEMORY_WARMUP_S = 120.0  # "flat after warm-up": RSS from here to the end
MEMORY_FLAT_PCT = 5.0
KEPT_UP_PCT = 99.0


# --- senders ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Load:
    """What every sender process is told: where to send, how much, for how long."""

    addr: str
    world: int
    rate: int  # steps batches a second per rank
    rpm: int  # records per steps batch
    conns: int  # DEALER connections per sender process
    seconds: float
    senders: int
    cores: set[int] | None  # where the senders run (None: anywhere)


@dataclass(frozen=True)
class Sync:
    """Shared with the senders: their counts (sent, dropped per sender), and the signals."""

    counts: Any  # mp.Array("q", 2 * senders)
    ready: list[Any]  # one Event per sender: templates built, hellos sent
    go: Any  # Event: start.value holds the monotonic start time
    start: Any
    stop: Any  # Event: stop sending now (the collector's memory passed the limit)
    quit: Any  # Event: close the connections (the collector has finished)


def run_sender(idx: int, load: Load, sync: Sync) -> None:
    """Drive ranks idx, idx + senders, ... until start + seconds, paced to the clock."""
    if load.cores is not None:
        os.sched_setaffinity(0, load.cores)
    world, rpm, counts = load.world, load.rpm, sync.counts
    ranks = list(range(idx, world, load.senders))
    rng, slow = random.Random(1234 + idx), world // 3
    ids = [Identity(r, r % 8, r // 8, f"node{r // 8:04d}", 100_000 + r, world) for r in ranks]
    tpl = [templates(i, rpm, rng, i.rank == slow) for i in ids]
    n_conns = max(1, min(len(ranks), load.conns))
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, n_conns + 64)
    socks = []
    for _ in range(n_conns):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM * -(-len(ranks) // n_conns))
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(load.addr)
        socks.append(sock)
    sock_of = [socks[k % n_conns] for k in range(len(ranks))]
    seq, step = [1] * len(ranks), [0] * len(ranks)
    sent = dropped = 0
    for k, ident in enumerate(ids):
        sock_of[k].send(protocol.encode("hello", ident, 0, time.time(), run="soak",
                                        device="cuda:0", backend="nccl", env={}))
        sent += 1
    # One second of traffic: `rate` rounds of steps, sys after round 0, heartbeat mid-way.
    pattern: list[tuple[int, int]] = []
    for rnd in range(load.rate):
        pattern += [(0, k) for k in range(len(ranks))]
        pattern += [(1, k) for k in range(len(ranks)) if rnd == 0]
        pattern += [(2, k) for k in range(len(ranks)) if rnd == load.rate // 2]
    counts[2 * idx], counts[2 * idx + 1] = sent, 0
    sync.ready[idx].set()
    sync.go.wait(300)
    t0, seconds = sync.start.value, load.seconds
    per_s, total = len(pattern), int(len(pattern) * seconds)
    i, published = 0, time.monotonic()
    while i < total and time.monotonic() < t0 + seconds + 5:  # bounded if we fall behind
        if sync.stop.is_set():
            break
        now = time.monotonic()
        due = min(total, int((now - t0) * per_s), i + SEND_CHUNK)
        if now - published >= PUBLISH_S:
            counts[2 * idx], counts[2 * idx + 1], published = sent, dropped, now
        if i >= due:
            time.sleep(0.002)
            continue
        wall = time.time()
        while i < due:
            kind, k = pattern[i % per_s]
            b = stamp(tpl[k][kind], seq[k], wall, step[k], rpm)
            step[k] += rpm if kind == 0 else 0
            seq[k], i = seq[k] + 1, i + 1
            try:
                sock_of[k].send(b, zmq.NOBLOCK)  # as agents do: never block, count drops
                sent += 1
            except zmq.Again:
                dropped += 1
    counts[2 * idx], counts[2 * idx + 1] = sent, dropped
    sync.quit.wait(600)  # keep the connections open while the collector drains them
    for sock in socks:
        sock.close(0)
    ctx.term()


# --- the collector ----------------------------------------------------------------------

class CollectorProcess:
    """The real collector in plain loopback mode; read, never disturbed, while it works."""

    def __init__(self, run_dir: Path, world: int, cores: set[int] | None) -> None:
        env = {k: v for k, v in os.environ.items() if k != "TRACEML_SECRET"}
        self.run_dir = run_dir
        run_dir.mkdir(parents=True)
        self.log = open(run_dir.parent / "collector.log", "wb")  # closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "traceml_tui.collect.collector", "--run-dir", str(run_dir),
             "--world-size", str(world), "--run-name", "soak"],
            stdout=self.log, stderr=subprocess.STDOUT, env=env,
            # Before it starts any thread: ZeroMQ's I/O thread inherits the mask.
            preexec_fn=None if cores is None else lambda: os.sched_setaffinity(0, cores))
        deadline = time.monotonic() + 60
        while not RunFolder(run_dir).collector_json.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"collector did not start: {self.output()}")
            time.sleep(0.05)
        self.info = json.loads(RunFolder(run_dir).collector_json.read_text())
        self.ps = psutil.Process(self.proc.pid)
        self.ctx = zmq.Context()
        self.snap_mtime = 0.0
        self.snap: tuple[float, dict[str, int]] | None = None

    def output(self) -> str:
        self.log.flush()
        return (self.run_dir.parent / "collector.log").read_text(errors="replace")[-2000:]

    def live(self) -> tuple[float, dict[str, int]] | None:
        """(epoch time of the collector's latest live snapshot, its counters)."""
        path = RunFolder(self.run_dir).live
        try:
            mtime = path.stat().st_mtime
            if mtime != self.snap_mtime:
                doc = json.loads(path.read_text())
                at = datetime.fromisoformat(doc["run"]["ended_at"]).timestamp()
                self.snap, self.snap_mtime = (at, doc["collector"]), mtime
        except (OSError, ValueError, KeyError):
            pass  # not written yet, or replaced while we read: the last one stands
        return self.snap

    def request(self, which: str, payload: bytes, timeout_s: float) -> list[bytes]:
        sock = self.ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.info[which])
        try:
            sock.send(payload)
            if not sock.poll(int(timeout_s * 1000)):
                raise TimeoutError(f"no reply on {which} in {timeout_s} s")
            return sock.recv_multipart()
        finally:
            sock.close()

    def view(self) -> bytes:
        return self.request("view", msgpack.packb({"op": "view"}), 30)[0]

    def finish(self, grace_s: float) -> dict[str, Any]:
        request = {"op": "finish", "grace_s": grace_s, "exit_code": 0}
        reply = json.loads(self.request("control", json.dumps(request).encode(),
                                        grace_s + 120)[0])
        self.proc.wait(60)
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.ctx.destroy(linger=0)
        self.log.close()


# --- sampling ---------------------------------------------------------------------------

@dataclass
class Sample:
    t: float  # seconds since the load started
    sent: int
    dropped: int
    ingested: int | None
    lag: int | None  # messages sent by the snapshot's time, not yet ingested
    lag_s: float | None
    snap_age_s: float | None
    rss_mib: float
    cpu_pct: float


class SenderCounts:
    """Sent and dropped counts of all senders, and their history (to place a snapshot)."""

    def __init__(self, counts: Any) -> None:
        self.counts = counts
        self.times: list[float] = []
        self.sent: list[int] = []

    def now(self) -> tuple[int, int]:
        c = list(self.counts)
        return sum(c[0::2]), sum(c[1::2])

    def record(self) -> None:
        self.times.append(time.time())
        self.sent.append(self.now()[0])

    def sent_at(self, epoch: float) -> int:
        """Sent by `epoch`, to within ~PUBLISH_S + HISTORY_S of traffic (the latest record
        taken after it: a lag is never understated)."""
        i = bisect_left(self.times, epoch)
        return self.sent[min(i, len(self.sent) - 1)] if self.sent else 0


def sample(t: float, senders: SenderCounts, coll: CollectorProcess, rate_per_s: float,
           cpu: tuple[float, float]) -> tuple[Sample, tuple[float, float]]:
    sent, dropped = senders.now()
    snap = coll.live()
    ingested = lag = lag_s = age = None
    if snap is not None:
        at, counters = snap
        ingested = counters["messages"] + counters["malformed"] + counters["foreign"]
        lag = max(0, senders.sent_at(at) - ingested)
        lag_s, age = lag / rate_per_s, time.time() - at
    times, wall = coll.ps.cpu_times(), time.monotonic()
    busy = times.user + times.system
    pct = 100 * (busy - cpu[0]) / max(1e-9, wall - cpu[1])
    return (Sample(t, sent, dropped, ingested, lag, lag_s, age, coll.ps.memory_info().rss / 2**20,
                   pct), (busy, wall))


def _fmt(s: Sample) -> str:
    def opt(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    return (f"{s.t:7.1f} {s.sent:>12,} {s.dropped:>9,} {opt(s.ingested, '>12,')} "
            f"{opt(s.lag, '>9,')} {opt(s.lag_s, '>7.2f')} {opt(s.snap_age_s, '>5.1f')} "
            f"{s.rss_mib:>8.1f} {s.cpu_pct:>6.1f}")


HEADER = (f"{'t_s':>7} {'sent':>12} {'dropped':>9} {'ingested':>12} {'lag_msgs':>9} "
          f"{'lag_s':>7} {'age_s':>5} {'rss_mib':>8} {'cpu_%':>6}")


# --- dashboard frame time on the collector's own RunView --------------------------------

class FrozenViews:
    """A ViewSource that serves the collector's encoded views, decoding one per fetch."""

    def __init__(self, payloads: list[bytes]) -> None:
        self.payloads, self.i = payloads, 0

    def fetch(self, pinned: int | None) -> tuple[Any, None]:
        from traceml_tui.viewmodel import decode_view

        self.i += 1
        return decode_view(self.payloads[self.i % len(self.payloads)]), None

    def summary(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


async def frame_times(payloads: list[bytes], frames: int) -> list[float]:
    """As benchmarks/dashboard_frame.py: CPU per refresh (decode, apply, draw) at 160x50."""
    from traceml_tui.view.dashboard import DashboardApp

    source = FrozenViews(payloads)
    app = DashboardApp(source, refresh_s=3600)  # we drive the refreshes
    out = []
    async with app.run_test(size=(160, 50)) as pilot:
        await pilot.pause(0.2)
        for _ in range(frames):
            t0 = time.process_time()
            view, detail = source.fetch(None)
            app.apply(view, detail, "")
            await pilot.pause()
            out.append((time.process_time() - t0) * 1000)
    return out[3:]


# --- orchestration ----------------------------------------------------------------------

def run(a: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="traceml-soak-"))
    ccores, scores = pinning(a.pin)
    coll = CollectorProcess(tmp / "run", a.ranks, ccores)
    mpc = mp.get_context("spawn")
    sync = Sync(counts=mpc.Array("q", 2 * a.senders, lock=False),
                ready=[mpc.Event() for _ in range(a.senders)], go=mpc.Event(),
                start=mpc.Value("d", 0.0, lock=False), stop=mpc.Event(), quit=mpc.Event())
    load = Load(coll.info["ingest"], a.ranks, a.rate, a.records_per_msg,
                -(-(a.conns or a.ranks) // a.senders), a.seconds, a.senders, scores)
    procs = [mpc.Process(target=run_sender, args=(i, load, sync), daemon=True)
             for i in range(a.senders)]
    rate_per_s = a.ranks * (a.rate + 2)
    print(f"soak: {a.ranks} ranks x ({a.rate} steps batches of {a.records_per_msg} record(s) "
          f"+ 1 sys + 1 heartbeat)/s = {rate_per_s:,} msgs/s for {a.seconds:.0f} s; "
          f"{a.senders} sender processes, {min(a.ranks, load.conns * a.senders)} connections; "
          f"collector pid {coll.proc.pid}; {os.cpu_count()} cores; collector on cores "
          f"{_cores(ccores)}, senders on {_cores(scores)}", flush=True)
    try:
        for p in procs:
            p.start()
        for ev in sync.ready:
            if not ev.wait(300):
                raise SystemExit("a sender did not get ready in 300 s")
        return _measure(a, coll, sync, rate_per_s)
    finally:
        sync.quit.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
        coll.close()
        shutil.rmtree(tmp, ignore_errors=True)


def pinning(pin: bool) -> tuple[set[int] | None, set[int] | None]:
    """The collector alone on the first core, the simulated ranks on the others (as
    benchmarks/collector_ingest.py): on a small machine the load generator must not be
    what starves the collector. None: not pinned."""
    if not pin or not hasattr(os, "sched_getaffinity"):
        return None, None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None, None
    return {cores[0]}, set(cores[1:])


def _cores(cores: set[int] | None) -> str:
    return "any" if cores is None else ",".join(map(str, sorted(cores)))


def _measure(a: argparse.Namespace, coll: CollectorProcess, sync: Sync,
             rate_per_s: float) -> int:
    senders = SenderCounts(sync.counts)
    t0 = time.monotonic() + 0.5
    sync.start.value = t0
    sync.go.set()
    cpu = (sum(coll.ps.cpu_times()[:2]), time.monotonic())
    samples: list[Sample] = []
    aborted = ""
    print(HEADER, flush=True)
    next_sample = t0 + a.interval
    while time.monotonic() < t0 + a.seconds:
        time.sleep(HISTORY_S)
        senders.record()
        if coll.proc.poll() is not None:
            raise SystemExit(f"the collector died: {coll.output()}")
        if time.monotonic() >= next_sample:
            next_sample += a.interval
            s, cpu = sample(time.monotonic() - t0, senders, coll, rate_per_s, cpu)
            samples.append(s)
            print(_fmt(s), flush=True)
        rss = coll.ps.memory_info().rss / 2**20
        if rss > a.max_rss_mib:
            aborted = f"collector RSS {rss:.0f} MiB > --max-rss-mib {a.max_rss_mib:.0f}"
            print(f"ABORTED at {time.monotonic() - t0:.1f} s: {aborted}; load stopped",
                  flush=True)
            sync.stop.set()
            break
    load_end = time.time()
    # The first snapshot written after the load stopped: what was ingested by then.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(HISTORY_S)
        senders.record()
        snap = coll.live()
        if snap is not None and snap[0] >= load_end:
            break
    end, cpu = sample(time.monotonic() - t0, senders, coll, rate_per_s, cpu)
    print(_fmt(end), "(first snapshot after the load stopped)", flush=True)
    views = [coll.view()]
    time.sleep(1.0)
    views.append(coll.view())
    reply = coll.finish(a.grace)
    final = json.loads(RunFolder(coll.run_dir).summary_json.read_text())
    frames = asyncio.run(frame_times(views, a.frames)) if a.frames else []
    return report(a, samples, end, final, reply, frames, aborted)


def report(a: argparse.Namespace, samples: list[Sample], end: Sample, final: dict[str, Any],
           reply: dict[str, Any], frames: list[float], aborted: str) -> int:
    """The table, the totals and the verdicts; exit status 0 only if every verdict passed."""
    print("\n--- table (every sample, then the first snapshot after the load stopped)")
    print(HEADER)
    for s in [*samples, end]:
        print(_fmt(s))
    tried = end.sent + end.dropped
    print(f"\nsent {end.sent:,} (+ {end.dropped:,} dropped at the senders' full sockets); "
          f"ingested {end.ingested or 0:,} by the first snapshot after the load; after finish "
          f"(grace {a.grace:.0f} s): {final['collector']} (finish ok: {reply.get('ok')})")
    steps = [r["steps"] for r in final["ranks"]]
    print(f"steps per rank in final_summary.json: min {min(steps):,}, max {max(steps):,}; "
          f"ranks reporting {final['run']['ranks_reporting']} of {final['run']['world_size']}")
    if frames:
        med, p90 = statistics.median(frames), sorted(frames)[int(0.9 * len(frames))]
        print(f"dashboard frame on the collector's final RunView ({a.ranks} ranks): median "
              f"{med:.1f} ms, p90 {p90:.1f} ms CPU ({len(frames)} frames, 160x50)")
    if aborted:
        print(f"VERDICT ingest kept up: FAIL - aborted: {aborted}")
        print("VERDICT memory flat after warm-up: FAIL - aborted")
        return 1
    kept = 100 * (end.ingested or 0) / max(1, tried)
    ok = kept >= KEPT_UP_PCT
    print(f"VERDICT ingest kept up: {'PASS' if ok else 'FAIL'} - {kept:.2f}% of the "
          f"{tried:,} messages the ranks tried to send were ingested by the end of the load "
          f"(need >= {KEPT_UP_PCT:.0f}%); max lag "
          f"{max((s.lag_s or 0.0) for s in [*samples, end]):.2f} s of traffic")
    return 0 if memory_verdict(a, samples) and ok else 1


def memory_verdict(a: argparse.Namespace, samples: list[Sample]) -> bool:
    """RSS growth from the end of the warm-up to the last sample of the load. Warm: past
    minute 2 (or half a shorter run) and past the time the step windows fill."""
    fill_s = window_steps_for(a.ranks) / (a.rate * a.records_per_msg)
    warm_at = max(min(a.warmup, a.seconds / 2), fill_s + a.interval)
    warm = next((s for s in samples if s.t >= warm_at), None)
    if warm is None or warm is samples[-1]:
        print(f"VERDICT memory flat after warm-up: n/a - no samples between the warm-up "
              f"({warm_at:.0f} s; windows fill at {fill_s:.0f} s) and the end")
        return True
    last = samples[-1]
    growth = 100 * (last.rss_mib - warm.rss_mib) / warm.rss_mib
    ok = growth < MEMORY_FLAT_PCT
    print(f"VERDICT memory flat after warm-up: {'PASS' if ok else 'FAIL'} - RSS "
          f"{warm.rss_mib:.1f} MiB at {warm.t:.0f} s -> {last.rss_mib:.1f} MiB at {last.t:.0f} s "
          f"({growth:+.2f}%, need < {MEMORY_FLAT_PCT:.0f}%; warm-up {warm_at:.0f} s, windows "
          f"full at {fill_s:.0f} s)")
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4096)
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--rate", type=int, default=10,
                   help="steps batches a second per rank (plus 1 sys + 1 heartbeat)")
    p.add_argument("--records-per-msg", type=int, default=1)
    p.add_argument("--senders", type=int, default=2, help="sender processes")
    p.add_argument("--conns", type=int, default=0,
                   help="DEALER connections in all (default: one per rank)")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="do not pin the collector to one core and the senders to the others")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between samples")
    p.add_argument("--warmup", type=float, default=MEMORY_WARMUP_S,
                   help="memory is judged from here to the end (capped at half the run)")
    p.add_argument("--max-rss-mib", type=float, default=4096.0,
                   help="stop the load (and fail) when the collector's RSS passes this")
    p.add_argument("--grace", type=float, default=5.0, help="finish: seconds to drain")
    p.add_argument("--frames", type=int, default=20, help="dashboard frames (0: skip)")
    a = p.parse_args()
    if not (1 <= a.ranks <= 1 << 20 and 1 <= a.rate <= 100 and 1 <= a.senders <= 64
            and 0 < a.seconds <= 24 * 3600 and a.interval > 0):
        p.error("out of range: ranks 1..2^20, rate 1..100, senders 1..64, seconds <= 1 day")
    return run(a)


if __name__ == "__main__":
    raise SystemExit(main())
