"""Issue 42, finding 3: a key holder cannot stall the collector.

As the issue made it: 32 connections with the run's key sending ~1 MiB steps messages
(valid ones, ~9,000 records each, as another process of ranks 0 and 1) as fast as the
collector takes them, beside a real 2-rank `traceml run` job (gloo, CPU). Before: the
drain checked each record in Python (~20 ms a message) and served every connection in
turn, the view socket answered nothing for 30 s, the live file went 12.8 s stale, a false
HANG was recorded and the ranks' messages waited (or were refused) behind the flood.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq
from test_security_collector import WORLD, Secured, ident

from jobs import EXAMPLES, kill_session, spawn_traceml, wait_for
from traceml_agent import keys
from traceml_agent.protocol import PHASES, Identity, encode
from traceml_tui.view.client import ViewClient, ViewUnavailable

SECRET = "ef" * 32
CONNECTIONS = 32
RECORDS = 9_000  # ~0.75 MiB a message
STEPS = 100


def _flood_payloads(world: int) -> list[bytes]:
    """Valid steps messages of ranks 0 and 1 from pids that are not theirs."""
    t = time.time()
    out = []
    for rank in range(world):
        ident = Identity(rank, rank, 0, "host", 4_000_000 + rank, world)
        recs = [[s, t, 10.0, *[1.0] * len(PHASES)] for s in range(RECORDS)]
        out.append(encode("steps", ident, 1, t, phases=list(PHASES), records=recs, dropped=0))
    return out


class Flood(threading.Thread):
    """CONNECTIONS dealers with the run's key, each sending whenever its pipe has room."""

    def __init__(self, ingest: str, payloads: list[bytes]) -> None:
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.socks = []
        for _ in range(CONNECTIONS):
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 4)
            keys.secure_client(sock, keys.derive(SECRET))
            sock.connect(ingest)
            self.socks.append(sock)
        self.payloads = payloads
        self.sent = 0
        self.halt = threading.Event()

    def run(self) -> None:
        poller = zmq.Poller()
        for sock in self.socks:
            poller.register(sock, zmq.POLLOUT)
        while not self.halt.is_set():
            for sock, _ in poller.poll(100):
                try:
                    sock.send(self.payloads[self.sent % len(self.payloads)], zmq.NOBLOCK)
                    self.sent += 1
                except zmq.Again:
                    pass

    def stop(self) -> None:
        self.halt.set()
        self.join(10)
        for sock in self.socks:
            sock.close()
        self.ctx.term()


def _live(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / "live_snapshot.json").read_text())
    except (OSError, ValueError):
        return None


@pytest.mark.e2e
def test_a_key_holders_flood_of_large_steps_stalls_nothing(tmp_path: Path) -> None:
    out, name = tmp_path / "runs", "drain"
    run_dir = out / name
    proc = spawn_traceml(
        "run", str(EXAMPLES / "ddp_toy.py"), "--nproc-per-node", "2", "--headless",
        "--out", str(out), "--run-name", name, "--",
        "--steps", str(STEPS), "--compute-ms", "100",
        env={"TRACEML_SECRET": SECRET})
    flood: Flood | None = None
    viewer: ViewClient | None = None
    try:
        wait_for(lambda: (doc := _live(run_dir)) is not None
                 and min([r["steps"] for r in doc["ranks"]] or [0]) >= 10, 90, "training")
        info = json.loads((run_dir / "collector.json").read_text())
        viewer = ViewClient(info["view"], timeout_s=20, secret=SECRET)
        collector = psutil.Process(info["pid"])
        rss_before = collector.memory_info().rss
        flood = Flood(info["ingest"], _flood_payloads(2))
        flood.start()
        slowest = stalest = 0.0
        rss_peak = rss_before
        started = time.monotonic()
        final = run_dir / "final_summary.json"
        while not final.exists() and time.monotonic() - started < 60:
            asked = time.monotonic()
            try:
                view, _ = viewer.fetch()  # the dashboard's own request
            except ViewUnavailable:
                if final.exists():  # the job ended meanwhile: the collector is gone
                    break
                raise
            slowest = max(slowest, time.monotonic() - asked)
            assert view.world_size == 2
            age = time.time() - (run_dir / "live_snapshot.json").stat().st_mtime
            with contextlib.suppress(psutil.Error):
                rss_peak = max(rss_peak, collector.memory_info().rss)
            stalest = max(stalest, age)
            time.sleep(0.2)
        sent = flood.sent
        flood.stop()
        flood = None
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-3000:]
        doc = json.loads((run_dir / "final_summary.json").read_text())
        counters = doc["collector"]
        print(f"flood: {sent} messages sent; slowest view {slowest:.2f} s, live file at most "
              f"{stalest:.1f} s old; steps {[r['steps'] for r in doc['ranks']]}; hang "
              f"{doc['hang']}; collector RSS +{(rss_peak - rss_before) >> 20} MiB at most; "
              f"counters {counters}")
        # What the user sees did not stall, and the record is the job's.
        assert [r["steps"] for r in doc["ranks"]] == [STEPS, STEPS], counters
        assert doc["hang"] is None and "HANG" not in json.dumps(doc["timeline"]), doc["hang"]
        assert slowest < 3.0, f"a view took {slowest:.1f} s"
        assert stalest < 8.0, f"the live file went {stalest:.1f} s stale"
        # The flood was real: most of it reached the collector and was refused there.
        assert sent >= 100, sent
        assert counters["not_owner"] + counters["foreign"] + counters["backlog_refused"] > 50
        assert counters["connections_over_cap"] > 0  # 32 > 2 x 2 + 16
    finally:
        if flood is not None:
            flood.stop()
        if viewer is not None:
            viewer.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(20)
            except Exception:
                kill_session(proc)
                proc.wait(10)


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[Secured]:
    collector = Secured(tmp_path / "run")
    yield collector
    collector.stop()


def test_connections_past_the_runs_cap_are_refused_counted_and_said(secured: Secured) -> None:
    """A key holder chose how many connections to open, each a pipe of up to 16 MiB and a
    turn in the round robin. Now at most cap_for(world) are open at once (2 x 2 + 16 for
    this 2-rank run); a connection closed makes room for another."""
    from traceml_tui.collect.connections import cap_for

    cap = cap_for(WORLD)
    first = [secured.dealer() for _ in range(cap + 12)]
    for i, sock in enumerate(first):  # each says something, as another process of rank 0
        sock.send(encode("heartbeat", ident(0, 5000 + i), 1, time.time(), step=0))
    heard = lambda: (c := secured.summary()["collector"])["messages"] + c["not_owner"]  # noqa: E731
    wait_for(lambda: heard() >= cap, 20, "the admitted connections")
    time.sleep(1.0)  # the refused ones would have been heard by now
    counters = secured.summary()["collector"]
    assert heard() == cap and counters["connections_over_cap"] >= 12, counters
    wait_for(lambda: "past the run's cap of 20" in secured.output(), 10, "the refusals said")
    for sock in first:
        sock.close()
    time.sleep(1.0)  # their ends seen by the collector's monitor
    again = [secured.dealer() for _ in range(cap)]
    for i, sock in enumerate(again):
        sock.send(encode("heartbeat", ident(0, 6000 + i), 1, time.time(), step=0))
    wait_for(lambda: heard() >= 2 * cap, 20, "room made by the closed ones")
    for sock in again:
        sock.close()
