"""Issue 42, finding 3: a key holder cannot stall the collector.

As the issue made it: 32 connections with the run's key sending ~1 MiB steps messages
(valid ones, ~9,000 records each, as another process of ranks 0 and 1) as fast as the
collector takes them, beside a real 2-rank `traceml run` job (gloo, CPU). Before: the
drain checked each record in Python (~20 ms a message) and served every connection in
turn, the view socket answered nothing for 30 s, the live file went 12.8 s stale, a false
HANG was recorded and the ranks' messages waited (or were refused) behind the flood.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from test_security_collector import WORLD, Secured, ident

from jobs import wait_for
from traceml_agent import keys
from traceml_agent.protocol import PHASES, Identity, encode

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
