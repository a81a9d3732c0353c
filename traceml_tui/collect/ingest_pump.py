"""The ingest socket's own thread: a receive backlog bounded in bytes across all peers.

libzmq bounds a ROUTER's receive queue per connection and in messages (RCVHWM), not in
bytes over all connections: four connections sending valid 1 MiB messages, slow to
decode, held 2.3 GiB after 15 s. This thread takes each frame off the socket as it
arrives (a few microseconds each, far faster than decoding) into a queue
per peer, and the collector's loop takes them round-robin, up to TURN_BYTES of each
peer's queue per turn (at least a message), so a peer that floods only lengthens its own
queue, and a rank's few-KiB messages are all served each turn.

Every queued frame counts against one budget for all peers together, whatever their
number (a key holder chooses how many connections to open: the issue saw ~17 MiB more
per connection when an empty queue always let its next frame in). A frame is refused
(and counted) when its peer's queue would pass PEER_BYTES, or when all queues together
would pass BACKLOG_BYTES; a peer whose queue stays under SMALL_QUEUE_BYTES (every rank:
a few KiB a message, served every turn) may also use RESERVE_BYTES above that, so an
ordinary rank never loses a message to somebody else's flood of large frames.

Bound: BACKLOG_BYTES + RESERVE_BYTES in all (256 MiB), plus libzmq's own pipe of at most
16 frames per connection (the collector's RCVHWM) while this thread waits for the GIL;
each connection needs the run's key, and their number is capped (connections.py).

Only this thread ever touches the ROUTER socket (ZeroMQ sockets are not thread-safe):
the collector's requests to ranks reach it through an inproc pair, which also wakes
the collector's poll when frames are waiting.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque

import zmq

from traceml_agent.protocol import RELAY_ROUTE, RELAY_TAG

# Where a request to a rank goes: its connection, and its route number at that
# connection's node relay (relay.py), or None when it sent directly.
Route = tuple[bytes, int | None]

BACKLOG_BYTES = 224 << 20  # all peers together
RESERVE_BYTES = 32 << 20  # ... and above it, for peers whose queue stays small
SMALL_QUEUE_BYTES = 256 << 10  # a rank's queue (a few KiB a message) stays far below
PEER_BYTES = 8 << 20  # one peer's queue
# A peer's share of one turn of the round robin: a rank's few-KiB messages all go in one
# turn, a flooder's 1 MiB frames one a turn. One message a turn let 32 connections of
# 1 MiB frames serve a rank 4 of its ~20 messages a second, its backlog ever longer.
TURN_BYTES = 64 << 10
GATHER_S = 0.002
TAKE_PER_WAKE = 10_000  # frames taken off the socket before looking at requests to send
BATCH_BYTES = 4 << 20  # received, not yet admitted: refused frames are let go per batch
_ids = itertools.count()


class IngestPump(threading.Thread):
    def __init__(self, ctx: zmq.Context, sock: zmq.Socket) -> None:
        super().__init__(name="traceml-ingest", daemon=True)
        self.sock = sock
        address = f"inproc://traceml-ingest-{next(_ids)}"
        self.wake = ctx.socket(zmq.PAIR)  # the collector's end: poll it, send through it
        self.wake.setsockopt(zmq.LINGER, 0)
        self.wake.bind(address)
        self._pump = ctx.socket(zmq.PAIR)
        self._pump.setsockopt(zmq.LINGER, 0)
        self._pump.connect(address)
        self._lock = threading.Lock()
        self._queues: dict[bytes, deque[list[bytes]]] = {}
        self._bytes: dict[bytes, int] = {}
        self._ready: deque[bytes] = deque()  # peers with frames queued, in serving order
        self.queued_bytes = 0
        self.peak_bytes = 0
        self.refused = 0  # frames refused because a queue was full
        self._halt = threading.Event()

    # --- the pump's thread ------------------------------------------------------------

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._pump, zmq.POLLIN)
        try:
            while not self._halt.is_set():
                events = dict(poller.poll(100))
                if self._pump in events:
                    self._forward()
                if self.sock in events:
                    # Let a few milliseconds of messages gather: one wake (and one turn
                    # of the GIL) per batch, not per message, at a few MiB of backlog.
                    time.sleep(GATHER_S)
                    self._take()
        finally:
            self._pump.close()
            self.sock.close()

    def _take(self) -> None:
        """What the socket holds now, admitted under one lock per batch of at most
        BATCH_BYTES (so refused frames are let go at once). Copied receives: for the
        few-KiB messages ranks send, cheaper than zero-copy frames, and the bytes
        counted are the bytes held."""
        recv = self.sock.recv_multipart
        woke = not self._ready
        for _ in range(TAKE_PER_WAKE // 64):
            got: list[list[bytes]] = []
            held = 0
            while held < BATCH_BYTES and len(got) < 64:
                try:
                    frames = recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                got.append(frames)
                held += sum(map(len, frames))
            if got:
                self._admit(got)
            if held < BATCH_BYTES and len(got) < 64:
                break  # the socket is empty
        if woke and self._ready:
            try:
                self._pump.send(b"", zmq.NOBLOCK)
            except zmq.Again:  # a wake-up is already waiting
                pass

    def _admit(self, got: list[list[bytes]]) -> None:
        with self._lock:
            queues, sizes = self._queues, self._bytes
            for frames in got:
                route = frames[0]
                size = sum(map(len, frames))
                mine = sizes.get(route, 0)
                if not self._fits(mine + size, size):
                    self.refused += 1
                    continue
                queue = queues.get(route)
                if queue is None:
                    queue = queues[route] = deque()
                    self._ready.append(route)
                queue.append(frames)
                sizes[route] = mine + size
                self.queued_bytes += size
            self.peak_bytes = max(self.peak_bytes, self.queued_bytes)

    def _fits(self, peer_after: int, size: int) -> bool:
        """Whether a frame of `size` fits, its peer's queue then `peer_after` bytes."""
        if peer_after > PEER_BYTES:
            return False
        budget = BACKLOG_BYTES + (RESERVE_BYTES if peer_after <= SMALL_QUEUE_BYTES else 0)
        return self.queued_bytes + size <= budget

    def _forward(self) -> None:
        while True:
            try:
                parts = self._pump.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(parts) in (2, 4):
                try:
                    self.sock.send_multipart(parts, zmq.NOBLOCK)
                except zmq.ZMQError:  # the rank is gone or its pipe is full: a lost request
                    pass

    # --- the collector's side -----------------------------------------------------------

    def pending(self) -> bool:
        return bool(self._ready)

    def waiting_routes(self) -> frozenset[bytes]:
        """The connections (routing ids; a relay's for all its node's ranks) whose
        messages wait here now, not yet taken."""
        with self._lock:
            return frozenset(self._queues)

    def take(self, limit: int, max_bytes: int = 1 << 62) -> list[list[bytes]]:
        """Up to `limit` messages (and `max_bytes`, at least one message), each peer in
        turn up to TURN_BYTES of its queue (at least one message). Clears the wake-ups."""
        while True:
            try:
                self.wake.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        taken: list[list[bytes]] = []
        with self._lock:
            ready, queues, sizes = self._ready, self._queues, self._bytes
            held = 0
            while ready and len(taken) < limit and held < max_bytes:
                route = ready.popleft()
                queue = queues[route]
                turn = 0
                while True:
                    frames = queue.popleft()
                    size = sum(map(len, frames))
                    turn += size
                    taken.append(frames)
                    if not queue or len(taken) >= limit or turn >= TURN_BYTES:
                        break
                held += turn
                self.queued_bytes -= turn
                if queue:
                    sizes[route] -= turn
                    ready.append(route)
                else:
                    del queues[route], sizes[route]
        return taken

    def send(self, route: Route, payload: bytes) -> None:
        """A request to the rank behind `route`, sent by the pump's thread."""
        conn, relayed = route
        if relayed is None:
            self.wake.send_multipart([conn, payload])
        else:
            self.wake.send_multipart([conn, RELAY_TAG, RELAY_ROUTE.pack(relayed), payload])

    def stop(self) -> None:
        self._halt.set()
        try:  # one frame, not a request: wakes the pump's poll at once
            self.wake.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        if self.is_alive():
            self.join(5)
        self.wake.close()
