"""Key holders' connections to the ingest port, capped per run (issue 42, finding 3).

Every connection that completes the handshake gets a pipe of its own in libzmq (up to
16 frames of up to 1 MiB while the pump waits for the GIL) and a turn in the pump's
round robin: a key holder opening hundreds of them grew the collector's memory ~17 MiB
each, and lengthened every rank's wait for its turn. A run needs few: one per rank that
reports directly (all of a single node's; node 0's on several nodes) and one per other
node's relay. So the ingest socket's handshakes go to their own ZAP domain, and the
authenticator admits a connection only while fewer than `cap_for(world_size)` are open:

    cap = 2 x world_size + SLACK

Twice the world: every rank may reconnect, or torchrun restart it, while its old
connection's end is not yet seen (the monitor reports it within a poll); SLACK for
scripts that call traceml_agent.init() beside the job and for an elastic world at its
largest. A connection past the cap fails its handshake (libzmq closes it at once), is
counted (`collector.connections_over_cap`) and said in the collector's log at powers of
two, as the other refusals are. Without a secret there is no handshake to refuse:
the collector then listens on loopback only, and nothing is capped.

Open connections are counted from the ingest socket's monitor, in the collector's loop:
every connection libzmq accepts ends its handshake once, succeeded or failed (refused,
timed out, gone), and is disconnected once, so those open are the handshakes succeeded
and failed less the disconnections (libzmq 4.3 gives no descriptor with a success to pair
them by). Those admitted but not yet seen succeeding count too, in the authenticator's
thread, so a burst of connections between two reads of the monitor cannot pass the cap.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

import zmq

from traceml_agent import keys

from .descriptors import HANDSHAKE_IVL_MS

SLACK = 16
ZAP_DOMAIN = keys.ZAP_DOMAIN + "/ingest"  # the ingest socket's handshakes, apart
SUCCEEDED = zmq.EVENT_HANDSHAKE_SUCCEEDED
FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
          | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
EVENTS = SUCCEEDED | FAILED | zmq.EVENT_DISCONNECTED
# An admitted handshake not seen succeeding after this long has failed (its peer left).
PENDING_S = HANDSHAKE_IVL_MS / 1000.0


def cap_for(world_size: int) -> int:
    return 2 * max(1, world_size) + SLACK


class ConnectionCap:
    """The ingest socket's open connections, and the authenticator's decision."""

    def __init__(self, cap: int, say: Callable[[str], None]) -> None:
        self.cap = cap
        self.say = say
        self.ended = 0  # handshakes ended (succeeded or failed) less disconnections
        self._pending: deque[float] = deque()  # admitted, not yet seen succeeding
        self._lock = threading.Lock()
        self.refused = 0
        self._said = 0

    def admit(self) -> bool:
        """The authenticator's thread: one more connection may complete its handshake."""
        now = time.monotonic()
        with self._lock:
            pending = self._pending
            while pending and now - pending[0] > PENDING_S:
                pending.popleft()
            if self.open + len(pending) >= self.cap:
                self.refused += 1
                return False
            pending.append(now)
            return True

    @property
    def open(self) -> int:
        """Connections past a successful handshake, not yet disconnected."""
        return max(0, self.ended)

    def seen(self, event: int, value: int) -> None:
        """The collector's loop: an event of the ingest socket's monitor."""
        with self._lock:
            if event & SUCCEEDED:
                self.ended += 1
                if self._pending:
                    self._pending.popleft()
            elif event & FAILED:
                self.ended += 1
            elif event & zmq.EVENT_DISCONNECTED:
                self.ended -= 1

    def tell(self) -> None:
        """Say the refusals so far, at powers of two of their count."""
        refused = self.refused
        if refused.bit_length() > self._said.bit_length():  # 1, 2, 4, 8... (or past one)
            self._said = refused
            self.say(f"refused {refused} connection{'s' if refused != 1 else ''} to the "
                     f"ingest port past the run's cap of {self.cap} open at once (a script "
                     f"with the run's key opening connections?); the run goes on")
