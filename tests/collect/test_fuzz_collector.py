"""Fuzz the collector: hostile traffic never crashes it, never grows it, never costs the record.

The main test starts a real collector process (`python -m traceml_tui.collect.collector`, plain
loopback mode) and sends 100,000 hostile messages to its ingest socket (tests/support/hostile.py:
random bytes, truncated and mangled msgpack, every field swapped for anything msgpack can
carry, NaN and infinities, huge numbers, strings, arrays and nesting, unknown versions and
kinds, ranks out of range, extension types, other runs' messages, multi-frame sends),
interleaved with ~5,000 valid messages of the run's four ranks, replayed and late batches
included. After every chunk it waits until the collector's counters account for every
message sent so far (so nothing is lost silently to the receive high-water mark), and at
the end the record must be exact: every valid record counted once, every duplicate counted
as one, every hostile message counted as malformed or foreign. The in-process property
test checks the same promise of `decode` + `RunState` and the collector's tick path.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import psutil
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

import hostile
from hostile import FOREIGN, MALFORMED, VALID, WORLD, Expected
from traceml_agent.protocol import MAX_MESSAGE_BYTES, ProtocolError, decode
from traceml_tui import viewmodel
from traceml_tui.collect import view_build
from traceml_tui.collect.collector import TRANSPORT_FRAME_LIMIT as TRANSPORT_LIMIT
from traceml_tui.judge.ingest import MAX_RUN_PHASES
from traceml_tui.judge.state import RunState
from traceml_tui.report import summary
from traceml_tui.runfolder import summary_model as model
from traceml_tui.runfolder.layout import RunFolder

N_HOSTILE = 100_000
N_VALID = 5_000
SEED = 8
CHUNK = 5_000  # sends between two checks that the collector has taken all of them
POOL = 800  # hypothesis-drawn hostile payloads that the seeded generator re-mangles
RSS_GROWTH_MIB = 64  # generous: it grows ~5 MiB (4 ranks' windows, caches) whatever is sent
COUNTED = ("messages", "malformed", "foreign")


# --- a real collector process -------------------------------------------------------------

class CollectorProcess:
    """`python -m traceml_tui.collect.collector` in plain loopback mode, and its three sockets."""

    def __init__(self, run_dir: Path) -> None:
        env = {k: v for k, v in os.environ.items() if k != "TRACEML_SECRET"}
        self.run_dir = run_dir
        self.log = open(run_dir.parent / "collector.log", "wb")  # closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "traceml_tui.collect.collector", "--run-dir", str(run_dir),
             "--world-size", str(WORLD), "--run-name", "fuzz"],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.ctx = zmq.Context()
        deadline = time.monotonic() + 30
        info_path = run_dir / "collector.json"
        while not info_path.exists():
            assert self.proc.poll() is None, f"collector exited: {self.output()}"
            assert time.monotonic() < deadline, "collector did not announce its sockets"
            time.sleep(0.05)
        self.info = json.loads(info_path.read_text())
        self.ps = psutil.Process(self.proc.pid)

    def output(self) -> str:
        self.log.flush()
        return (self.run_dir.parent / "collector.log").read_text(errors="replace")[-3000:]

    def request(self, which: str, payload: bytes, timeout_s: float = 10.0) -> bytes:
        """One REQ/REP exchange on a fresh socket (a REQ that timed out is unusable)."""
        sock = self.ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.info[which])
        try:
            sock.send(payload)
            deadline = time.monotonic() + timeout_s
            while not sock.poll(50):
                alive = self.proc.poll() is None
                if not alive or time.monotonic() > deadline:
                    raise AssertionError(f"no reply on {which} (collector alive: {alive})\n"
                                         f"{self.output()}")
            return sock.recv()
        finally:
            sock.close()

    def control(self, request: dict[str, Any], timeout_s: float = 10.0) -> dict[str, Any]:
        return json.loads(self.request("control", json.dumps(request).encode(), timeout_s))

    def summary(self) -> dict[str, Any]:
        return msgpack.unpackb(self.request("view", msgpack.packb({"op": "summary"})))

    def counters(self) -> dict[str, int]:
        return self.summary()["collector"]

    def rss_mib(self) -> float:
        return self.ps.memory_info().rss / 2**20

    def peak_rss_mib(self) -> float:
        """VmHWM: the highest RSS the process ever had (catches a spike between samples)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmHWM in /proc/PID/status")

    def dealer(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, 10_000)  # a collector that stopped reading fails us
        sock.connect(self.info["ingest"])
        return sock

    def wait_counted(self, total: int, timeout_s: float = 60.0) -> dict[str, int]:
        """Until the counters account for `total` sends: none may vanish unseen."""
        deadline = time.monotonic() + timeout_s
        while True:
            counters = self.counters()
            seen = sum(counters[k] for k in COUNTED)
            if seen >= total or time.monotonic() > deadline:
                assert seen == total, f"collector counted {seen} of {total} sends: {counters}"
                return counters
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.ctx.destroy(linger=0)
        self.log.close()


@pytest.fixture
def collector(tmp_path):
    proc = CollectorProcess(tmp_path / "run")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def pool() -> list[bytes]:
    return hostile.draw_pool(hostile.HOSTILE_PAYLOADS, POOL)


# --- the fuzz -----------------------------------------------------------------------------

def test_collector_survives_hostile_traffic_and_keeps_an_exact_record(collector, pool):
    items, exp = hostile.traffic(N_HOSTILE, N_VALID, SEED, pool)
    assert exp.counts[MALFORMED] + exp.counts[FOREIGN] == N_HOSTILE
    # The traffic does what it claims: hostility of every sort, replays and late batches.
    assert exp.counts[MALFORMED] > 0.7 * N_HOSTILE and exp.counts[FOREIGN] > 0.05 * N_HOSTILE
    assert exp.duplicates > 500 and exp.records > 10_000
    assert sum(len(f) != 1 for f in items) > 1_000
    assert any(len(f) == 1 and len(f[0]) > MAX_MESSAGE_BYTES for f in items)
    # Frames over the transport's limit never reach the collector: libzmq drops them (and
    # the sender's connection) at the frame header. They have a test of their own below.
    oversized = [f for f in items if any(len(part) > TRANSPORT_LIMIT for part in f)]
    items = [f for f in items if all(len(part) <= TRANSPORT_LIMIT for part in f)]
    exp.counts[MALFORMED] -= len(oversized)

    sock = collector.dealer()
    rss: list[float] = []
    sent = 0
    for start in range(0, len(items), CHUNK):
        for frames in items[start:start + CHUNK]:
            sock.send_multipart(frames)
        sent += len(items[start:start + CHUNK])
        counters = collector.wait_counted(sent)
        rss.append(collector.rss_mib())
    sock.close()

    assert collector.proc.poll() is None, collector.output()
    assert collector.control({"op": "ping"}) == {"ok": True, "ranks": WORLD}
    assert_record(counters, collector.summary()["ranks"], exp)
    # Warm-up is the first chunk (imports, first ticks, the first snapshot file).
    growth = max(rss) - rss[0]
    assert growth < RSS_GROWTH_MIB, f"collector RSS grew by {growth:.1f} MiB: {rss}"

    reply = collector.control({"op": "finish", "grace_s": 0.2, "exit_code": 0})
    assert reply["ok"] and reply["exit_code"] == 0
    assert collector.proc.wait(15) == 0
    final = json.loads(RunFolder(collector.run_dir).summary_json.read_text())
    assert final["complete"] is True
    assert final["collector"] == counters
    assert_record(final["collector"], final["ranks"], exp)


def assert_record(counters: dict[str, int], ranks: list[dict[str, Any]], exp: Expected) -> None:
    """The collector's record against what was sent, by RunState.ingest's documented rules."""
    assert counters["messages"] == exp.counts[VALID]
    assert counters["malformed"] == exp.counts[MALFORMED]
    assert counters["foreign"] == exp.counts[FOREIGN]
    assert counters["records"] == exp.records
    assert counters["duplicate_records"] == exp.duplicates
    assert counters["agent_dropped"] == sum(exp.dropped)
    assert [r["steps"] for r in ranks] == exp.steps
    assert [r["dropped_records"] for r in ranks] == exp.dropped
    assert counters["bad_records"] == sum(exp.bad_records) > 0
    assert [r["bad_records"] for r in ranks] == exp.bad_records
    assert [r["pid"] for r in ranks] == [i.pid for i in hostile.IDENTS]


# --- what the fuzz found (fixed in traceml_tui/collect/collector.py; kept as regressions) ---

BIG_FRAME = 64 << 20


def test_an_oversized_frame_costs_the_collector_no_memory(collector):
    peak0 = collector.peak_rss_mib()
    sock = collector.dealer()
    sock.send(b"\0" * BIG_FRAME)
    deadline = time.monotonic() + 5  # received and counted, or refused by libzmq meanwhile
    while collector.counters()["malformed"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    sock.close()
    assert collector.control({"op": "ping"})["ok"]
    before = collector.counters()
    valid = collector.dealer()  # a well-behaved peer is still heard
    valid.send(hostile.Ranks(random.Random(0), Expected()).hello(0))
    assert collector.wait_counted(sum(before[k] for k in COUNTED) + 1)["messages"] == 1
    growth = collector.peak_rss_mib() - peak0
    assert growth < 16, f"one {BIG_FRAME >> 20} MiB frame raised the peak RSS by {growth:.0f} MiB"


CONTROL_CRASHES = {
    # handle_control catches ValueError and AttributeError only; json.loads raises
    # RecursionError on deep nesting.
    "deep-json": b"[" * 100_000,
    # finish() converts its fields outside any try: a wrong type raises out of serve().
    "finish-grace-str": b'{"op": "finish", "grace_s": "soon"}',
    "finish-command-int": b'{"op": "finish", "grace_s": 0, "command": 5}',
    "finish-extra-list": b'{"op": "finish", "grace_s": 0, "extra": [1]}',
}


@pytest.mark.parametrize("request_bytes", CONTROL_CRASHES.values(), ids=CONTROL_CRASHES.keys())
def test_control_socket_survives_malformed_requests(collector, request_bytes):
    reply = json.loads(collector.request("control", request_bytes, timeout_s=5))
    if reply.get("ok"):  # the collector chose to finish with defaults: then it wrote the record
        assert RunFolder(collector.run_dir).summary_json.exists()
    else:
        assert collector.control({"op": "ping"})["ok"]


def test_view_socket_answers_hostile_requests(collector):
    """Dashboards are untrusted readers: any request gets an answer and changes nothing."""
    requests = [msgpack.packb(v) for v in hostile.draw_pool(hostile.VALUES, 150)]
    requests += [msgpack.packb({"op": "view", "rank": r}) for r in (-1, WORLD, 1 << 63, 2.0)]
    requests += [hostile.deep_nesting(100_000), b"\xdd\xff\xff\xff\xff", b"", b"\xc1"]
    for request in requests:
        reply = collector.request("view", request, timeout_s=5)
        assert isinstance(msgpack.unpackb(reply), dict)
    assert collector.control({"op": "ping"}) == {"ok": True, "ranks": 0}
    assert sum(collector.counters()[k] for k in COUNTED) == 0


# --- the same promise in process ----------------------------------------------------------

@settings(max_examples=200, derandomize=True, deadline=None, database=None)
@given(st.lists(hostile.HOSTILE_PAYLOADS | hostile.valid_messages(), max_size=25))
def test_decode_and_ingest_raise_nothing_but_protocol_error(payloads):
    """Whatever arrives, decode raises ProtocolError or gives a message RunState takes,
    and the collector's tick (evaluate, snapshot, summary, view) still works on the result."""
    state = RunState("fuzz", WORLD, started_at=hostile.T0)
    mono, decoded = 0.0, 0
    for payload in payloads:
        mono += 0.1
        try:
            msg = decode(payload)
        except ProtocolError:
            state.intake.count_malformed()
            continue
        decoded += 1
        state.ingest(msg, mono)
    now = hostile.T0 + mono
    state.evaluate(now, mono + 60.0)  # a minute of silence: the hang check runs too
    snap = state.snapshot(now, mono + 60.0, full=True)
    doc = model.to_doc(summary.build(snap, summary.RunMeta(complete=False)))
    json.dumps(doc, allow_nan=False)  # strict JSON: no NaN or infinity reached the record
    viewmodel.encode_view(view_build.build(snap, state.recent_steps))
    assert state.counters["messages"] + state.counters["foreign"] == decoded
    assert state.counters["malformed"] >= len(payloads) - decoded
    assert len(state.phases) <= MAX_RUN_PHASES
    assert all(rs.window.count <= state.window_steps for rs in state.ranks.values())


def test_viewers_are_served_while_the_collector_waits_for_goodbyes(collector):
    """`finish` waits (a bounded grace) for ranks that have not said goodbye; viewers go on
    being answered meanwhile, and the launcher gets its reply once the record is written."""
    import threading

    from traceml_agent.protocol import Identity, encode

    sock = collector.dealer()  # a rank that reports and never says goodbye
    sock.send(encode("hello", Identity(0, 0, 0, "h", 1, WORLD), 0, time.time(), run="fuzz",
                     device="cpu", env={}, auto=True))
    collector.wait_counted(1)
    replies: dict[str, Any] = {}
    launcher = threading.Thread(target=lambda: replies.update(collector.control(
        {"op": "finish", "grace_s": 3.0, "exit_code": 0}, timeout_s=20)))
    t0 = time.monotonic()
    launcher.start()
    time.sleep(0.3)  # the finish request is in
    view_times = []
    while launcher.is_alive() and len(view_times) < 5:
        t = time.monotonic()
        collector.summary()
        view_times.append(time.monotonic() - t)
    launcher.join(20)
    assert replies.get("ok") and time.monotonic() - t0 >= 2.5  # it did wait for rank 0
    assert view_times and max(view_times) < 1.0, view_times  # before: blocked up to the grace
    sock.close()


def test_a_key_holder_cannot_end_the_record_with_requests_or_counts(collector):
    """Issue 20, findings 2 and 3, as an attacker with the key would try them: a capture
    request with a non-integer after the 8th rank, and ranks whose restarts claim 2**62
    dropped records each, pushing the sum past 2**64. The collector answers and lives."""
    from traceml_agent.protocol import PHASES, Identity, encode

    reply = msgpack.unpackb(collector.request("view", msgpack.packb(
        {"op": "capture", "steps": 2, "ranks": list(range(9)) + ["x"]})))
    # Refused by the request's decoder (requests.CaptureStart), naming the field.
    assert not reply.get("ok") and "$.ranks[9]" in reply["error"], reply
    sock = collector.dealer()
    for pid in range(8):  # the same rank "restarting" (hello, new pid), each time 2**62
        ident = Identity(0, 0, 0, "h", 100 + pid, WORLD)
        sock.send(encode("hello", ident, 0, time.time(), run="fuzz", device="cpu", env={},
                         auto=True))
        sock.send(encode("steps", ident, 1, time.time(), phases=list(PHASES), records=[],
                         dropped=1 << 62))
    collector.wait_counted(16)
    counters = collector.summary()["collector"]  # the export key's request
    assert counters["agent_dropped"] == (1 << 63) - 1
    assert collector.proc.poll() is None
    sock.close()


# --- a key holder's flood: the backlog is bounded in bytes across peers ---------------------

FLOOD_S = 12
FLOOD_BOUND_MIB = 400  # docs/security.md: 256 MiB of backlog, one frame per peer, decoding


def _big_steps(rank: int, pid: int) -> bytes:
    """A valid steps message as large as the protocol allows: the costliest to decode."""
    from traceml_agent import protocol

    ident = protocol.Identity(rank, rank, 0, "flood", pid, WORLD)
    records = [[i, hostile.T0, 1.0, *[0.1] * 7] for i in range(11_000)]
    frame = protocol.encode("steps", ident, 1, hostile.T0, phases=list(protocol.PHASES),
                            records=records, dropped=0)
    assert len(frame) <= MAX_MESSAGE_BYTES
    return frame


def _findings(rank: int, pid: int, seq: int) -> bytes:
    from traceml_agent import protocol
    from traceml_agent.findings import CHECKS, MAX_FINDING_RANKS

    ident = protocol.Identity(rank, rank, 0, "flood", pid, WORLD)
    ids = sorted(CHECKS)
    findings = [{"id": ids[(seq + i) % len(ids)], "severity": "critical",
                 "ranks": list(range(MAX_FINDING_RANKS)), "evidence": "e" * 512,
                 "fix": "f" * 512} for i in range(protocol.MAX_FINDINGS)]
    return protocol.encode("checks", ident, seq, hostile.T0, findings=findings, facts=None)


def test_a_flood_of_1_mib_frames_from_4_connections_costs_no_real_step(collector):
    """Four connections of a key holder (speaking for rank 0) send valid 1 MiB steps
    messages and 10,000 checks messages full of findings as fast as they can, while
    ranks 1-3 step normally: the collector stays within its documented bound, answers
    viewers, and records every real step."""
    from traceml_agent import protocol

    peak0 = collector.peak_rss_mib()
    floods = [_big_steps(0, 4242)] + [_findings(0, 4242, i) for i in range(10_000)]
    stop = time.monotonic() + FLOOD_S  # after building them: that takes seconds on a busy VM
    sent = [0] * 4

    def flood(i: int) -> None:
        sock = collector.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(collector.info["ingest"])
        n = 0
        while time.monotonic() < stop:
            frame = floods[0] if i < 3 else floods[1 + n % 10_000]
            try:
                sock.send(frame, zmq.NOBLOCK)
                n += 1
            except zmq.Again:
                time.sleep(0.001)
        sent[i] = n
        sock.close()

    import threading

    threads = [threading.Thread(target=flood, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    real = {}
    for rank in (1, 2, 3):
        sock = collector.dealer()
        ident = protocol.Identity(rank, rank, 0, "real", 100 + rank, WORLD)
        sock.send(protocol.encode("hello", ident, 0, hostile.T0, run="fuzz", device="cpu",
                                  backend="gloo", env={}, auto=True))
        real[rank] = (sock, ident)
    step = 0
    while time.monotonic() < stop:
        for sock, ident in real.values():
            records = [[s, hostile.T0 + s, 10.0, 1.0, None, 4.0, 4.0, 0.5, 0.5, 0.0]
                       for s in range(step, step + 5)]
            sock.send(protocol.encode("steps", ident, 1 + step, hostile.T0,
                                      phases=list(protocol.PHASES), records=records,
                                      dropped=0))
        step += 5
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert sent[3] >= 1_000 and min(sent[:3]) >= 50, sent  # it was a flood
    # Every real step, once the collector has worked through what it admitted.
    deadline = time.monotonic() + 120
    while True:
        ranks = collector.summary()["ranks"]
        steps = [r["steps"] for r in ranks[1:]]
        if steps == [step] * 3 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert steps == [step] * 3, (steps, step)
    growth = collector.peak_rss_mib() - peak0
    print(f"flood: sent {sent}, real steps {step} per rank, peak RSS +{growth:.0f} MiB")
    assert growth < FLOOD_BOUND_MIB, f"peak RSS grew {growth:.0f} MiB under the flood"
    assert collector.proc.poll() is None
