"""The ingest pump's backlog: one byte budget for all peers, whatever their number (issue
42, finding 3: a peer whose queue was empty always got its next frame in, so each of a key
holder's connections added ~1 MiB past the budget, and libzmq's pipe 16 more)."""

from __future__ import annotations

import zmq

from traceml_tui.collect import ingest_pump
from traceml_tui.collect.ingest_pump import (
    BACKLOG_BYTES,
    PEER_BYTES,
    RESERVE_BYTES,
    IngestPump,
)

MIB = 1 << 20


def _pump() -> tuple[zmq.Context, IngestPump]:
    ctx = zmq.Context()
    return ctx, IngestPump(ctx, ctx.socket(zmq.ROUTER))  # not started: _admit by hand


def _close(ctx: zmq.Context, pump: IngestPump) -> None:
    pump.wake.close()
    pump._pump.close()
    pump.sock.close()
    ctx.term()


def test_any_number_of_flooding_connections_stays_within_one_budget() -> None:
    ctx, pump = _pump()
    try:
        for _turn in range(3):  # 1,000 connections, each sending 1 MiB frames
            pump._admit([[b"flood%d" % i, b"x" * MIB] for i in range(1000)])
        assert pump.peak_bytes <= BACKLOG_BYTES + RESERVE_BYTES
        assert pump.queued_bytes <= BACKLOG_BYTES  # large frames never take the reserve
        assert pump.refused >= 3000 - BACKLOG_BYTES // MIB
        # ... and a rank's next small messages still get in, queue or not.
        for _seq in range(50):
            pump._admit([[b"rank0", b"s" * 2000], [b"rank1", b"h" * 300]])
        assert len(pump._queues[b"rank0"]) == 50 and len(pump._queues[b"rank1"]) == 50
        # Served one per peer per turn: the ranks' are among the first taken.
        first = {frames[0] for frames in pump.take(400)}
        assert {b"rank0", b"rank1"} <= first
    finally:
        _close(ctx, pump)


def test_one_peer_is_held_to_its_own_share() -> None:
    ctx, pump = _pump()
    try:
        pump._admit([[b"one", b"x" * MIB] for _ in range(50)])
        assert pump.queued_bytes <= PEER_BYTES and pump.refused >= 50 - PEER_BYTES // MIB
    finally:
        _close(ctx, pump)


def test_small_queues_use_the_reserve_only_up_to_the_total(monkeypatch) -> None:
    monkeypatch.setattr(ingest_pump, "BACKLOG_BYTES", 4 * MIB)
    monkeypatch.setattr(ingest_pump, "RESERVE_BYTES", 1 * MIB)
    ctx, pump = _pump()
    try:
        pump._admit([[b"big%d" % i, b"x" * (MIB - 4)] for i in range(8)])
        assert pump.queued_bytes == 4 * MIB  # four big ones, the rest refused
        pump._admit([[b"small%d" % i, b"s" * 100_000] for i in range(20)])
        assert len(pump._queues) == 4 + 10  # ten small ones from the reserve: then full
        assert pump.queued_bytes <= 5 * MIB and pump.refused == 4 + 10
    finally:
        _close(ctx, pump)


def test_a_rank_is_served_whole_each_turn_beside_floods_of_large_frames() -> None:
    """One message per peer per turn served 32 flooders' 1 MiB frames and one of a rank's
    ~20 messages a second in turn: its backlog grew without end. Its few-KiB messages
    now all go in its turn (TURN_BYTES)."""
    ctx, pump = _pump()
    try:
        pump._admit([[b"rank0", b"s" * 1500] for _ in range(20)])
        pump._admit([[b"flood%d" % i, b"x" * MIB] for i in range(32) for _ in range(4)])
        served = 0
        for _ in range(33):  # one turn: each peer once, a drain's take at a time
            served += sum(frames[0] == b"rank0" for frames in pump.take(256, MIB))
        assert served == 20
    finally:
        _close(ctx, pump)
