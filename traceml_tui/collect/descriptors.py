"""The collector's descriptors, whatever its sockets are doing.

Every connection to the collector's ports costs it a descriptor: libzmq accepts each
TCP connection (with or without the run's key) before the CURVE handshake can fail, and
the metrics server accepts scrapers. ~1,000 idle connections once exhausted a soft limit
of 1,024: snapshot writes failed with EMFILE and the record ended incomplete. So:

- the soft limit goes up to the hard limit at start (`raise_limit`);
- the handshake of a connection that never completes one ends after HANDSHAKE_IVL_MS
  (libzmq's default is 30 s), on every socket;
- a few descriptors are held back (`Reserve`) for the collector's own file writes,
  so a snapshot or the summary never fails for want of one (`write_anyway`);
- connections refused or timed out in the handshake are counted (`HandshakeCounter`,
  from libzmq's socket monitor), shown beside the ingest counters.
"""

from __future__ import annotations

import errno
import itertools
import os
import resource
import signal
import time
from collections.abc import Callable
from typing import TypeVar

import zmq
from zmq.utils.monitor import recv_monitor_message

# A peer has this long to complete the ZeroMQ/CURVE handshake after connecting: a real
# one takes a few ms even across a WAN; an idle or stalled connection gives its
# descriptor back after this, not after libzmq's default 30 s.
HANDSHAKE_IVL_MS = 5_000
# Descriptors held for the collector's own files: an atomic write needs the temporary
# file and its folder (private.write_atomic), the step log one per open segment, the
# capture analysis a pipe or three.
RESERVE_FDS = 16
# The soft limit raised to at most this (a hard limit may be "unlimited").
MAX_SOFT_LIMIT = 1 << 20
T = TypeVar("T")
# How long the forked writer may take (a snapshot at 16,384 ranks: ~1 s) before it is
# killed: the collector's loop must never wait on it for long.
WRITE_CHILD_TIMEOUT_S = 10.0
# Handshake failures counted: a peer that timed out or spoke no ZMTP (AUTH, a peer
# without the key, is counted by the authenticator as rejected_peers). Not accepts that
# failed: out of descriptors, libzmq retries its accept at once, hundreds of thousands
# of times a minute, and each would be an event to read.
FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL


def raise_limit() -> tuple[int, int]:
    """The soft descriptor limit raised to the hard one; returns (soft, hard) after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = MAX_SOFT_LIMIT if hard == resource.RLIM_INFINITY else min(hard, MAX_SOFT_LIMIT)
    if want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft, hard


class Reserve:
    """RESERVE_FDS descriptors on /dev/null, held for `write_anyway`."""

    def __init__(self, n: int = RESERVE_FDS) -> None:
        self.n = n
        self.fds: list[int] = []
        self.refill()

    def refill(self) -> None:
        while len(self.fds) < self.n:
            try:
                self.fds.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
            except OSError:
                return

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()


def write_anyway(write: Callable[[], T], reserve: Reserve) -> T | None:
    """`write()`, and if the process is out of descriptors, `write()` again in a forked
    child that first closes the reserve: a descriptor let go in this process is taken at
    once by libzmq's I/O thread (it retries its accept as long as connections wait), but
    the child's descriptor table is its own. Returns write()'s value (None from the child).
    Raises OSError if it still fails."""
    try:
        return write()
    except OSError as exc:
        if exc.errno != errno.EMFILE:
            raise
    pid = os.fork()
    if pid == 0:  # the child: os-level calls only, then _exit (no atexit, no flushing)
        code = 1
        try:
            reserve.close()
            write()
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + WRITE_CHILD_TIMEOUT_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:  # stuck (a lock another thread held at the fork)
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            break
        time.sleep(0.002)
    if os.waitstatus_to_exitcode(status) != 0:
        raise OSError(errno.EMFILE, "out of descriptors, even with the reserve")
    return None


def limit_handshake(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)


_MONITORS = itertools.count()


def monitor_socket(sock: zmq.Socket, events: int) -> zmq.Socket:
    """The socket's monitor (a PAIR receiving its events) on an inproc address of its
    own. pyzmq's default names the address by the socket's descriptor, which the kernel
    hands out again once a socket closes: the next socket's monitor then failed with
    "Address already in use" while the closed one's endpoint was still being released
    (two collectors one after the other in one process: a fresh-clone run)."""
    addr = f"inproc://traceml-monitor-{os.getpid()}-{next(_MONITORS)}"
    return sock.get_monitor_socket(events, addr=addr)


def stop_monitor(sock: zmq.Socket, mon: zmq.Socket) -> None:
    """pyzmq's documented teardown, on the socket's own thread and before it closes:
    monitoring off, then the monitor closed. A monitor closed while its socket still
    reports can leave libzmq's I/O thread sending an event nobody takes, and the
    context's term() waiting for ever (pyzmq #1554, libzmq #3575)."""
    try:
        sock.disable_monitor()
    except zmq.ZMQError:
        pass  # the socket is already closed: its monitoring ended with it
    mon.close(linger=0)


class HandshakeCounter:
    """Connections that failed or timed out in the handshake, on the sockets watched."""

    def __init__(self) -> None:
        self.monitors: list[zmq.Socket] = []
        self.others: list[Callable[[int, int], None] | None] = []
        self.failed = 0

    def watch(self, sock: zmq.Socket, events: int = 0,
              on_event: Callable[[int, int], None] | None = None) -> None:
        """Before the socket is handed to another thread (monitoring is set up on it).
        A socket has one monitor: with `on_event`, every event it reports (those
        counted here and `events`) goes to it too (connections.ConnectionCap)."""
        self.monitors.append(monitor_socket(sock, FAILED | events))
        self.others.append(on_event)

    def drain(self) -> int:
        for mon, on_event in zip(self.monitors, self.others, strict=True):
            while True:
                try:
                    event = recv_monitor_message(mon, zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError:
                    break
                if event["event"] & FAILED:
                    self.failed += 1
                if on_event is not None:
                    on_event(int(event["event"]), int(event["value"]))
        return self.failed

    def close(self) -> None:
        for mon in self.monitors:
            mon.close(linger=0)
        self.monitors.clear()
        self.others.clear()
