"""What a node's relay says on its node's terminal: strangers at its port, no rank in sight,
and a connection to node 0 whose handshakes all fail (issue 42, item 4).

The relay runs in its own process with its output in relay.log; before this, a relay
blinded by another user's idle connections, or one that never got through to node 0, left
its node's terminal silent while node 0 reported the node as never seen. So the relay
watches both of its sockets (libzmq's socket monitor: handshakes failed and succeeded) and
its traffic, and hands one line per news to the launcher, which prints it on the node's
terminal. Lines are counted and said at the 1st, 2nd, 4th, 8th... of each kind, as the
collector's and the browser view's refusals are, so a flood cannot flood the terminal.
"""

from __future__ import annotations

from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from .descriptors import monitor_socket, stop_monitor

# A rank of this node should reach the relay within this long of its start: torchrun
# starts the ranks at once and the agent connects on import (a slow `import torch` and
# a shared filesystem take tens of seconds, not minutes).
RANKS_WAIT_S = 60.0
FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
          | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
SUCCEEDED = zmq.EVENT_HANDSHAKE_SUCCEEDED


def power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class RelayWatch:
    """The relay's monitors and what they have said; `check(now)` each tick."""

    def __init__(self, local: zmq.Socket, up: zmq.Socket, address: str, upstream: str,
                 say: Callable[[str], None], started: float,
                 ranks_wait_s: float = RANKS_WAIT_S) -> None:
        """Before the sockets are used: the monitors must see their first events."""
        self._watched = (local, up)
        self._local = monitor_socket(local, FAILED)
        self._up = monitor_socket(up, FAILED | SUCCEEDED)
        self.address, self.upstream = address, upstream
        self.say = say
        self.started = started
        self.ranks_wait_s = ranks_wait_s
        self.strangers = 0  # local connections that failed or timed out in the handshake
        self.up_failed = 0  # handshakes with node 0 that failed
        self.up_ok = 0  # ... and that succeeded
        self._said_no_ranks = False

    @staticmethod
    def _events(mon: zmq.Socket) -> list[int]:
        out = []
        for _ in range(10_000):
            try:
                out.append(int(recv_monitor_message(mon, zmq.NOBLOCK)["event"]))
            except (zmq.Again, zmq.ZMQError):
                break
        return out

    def check(self, now: float, ranks_seen: bool) -> None:
        """Read the monitors and say what is news (at powers of two of each count)."""
        for _ in self._events(self._local):
            self.strangers += 1
            if power_of_two(self.strangers):
                self.say(f"refused {self.strangers} connection"
                         f"{'s' if self.strangers != 1 else ''} to this node's relay "
                         f"({self.address}) that did not complete the handshake in time or "
                         f"had not the run's key (another local user?); the relay goes on")
        for event in self._events(self._up):
            if event == SUCCEEDED:
                self.up_ok += 1
                if self.up_ok == 1 and self.up_failed:
                    self.say(f"the relay reached node 0 ({self.upstream}) after "
                             f"{self.up_failed} failed handshakes")
                continue
            self.up_failed += 1
            if not self.up_ok and power_of_two(self.up_failed):
                self.say(f"the relay's connection to node 0 ({self.upstream}) failed its "
                         f"handshake {self.up_failed} time{'s' if self.up_failed != 1 else ''}"
                         f" and never succeeded: node 0 does not see this node's ranks "
                         f"(another secret on node 0, or another program on that port?)")
        if not ranks_seen and not self._said_no_ranks and now - self.started > self.ranks_wait_s:
            self._said_no_ranks = True
            self.say(f"no rank of this node has reached its relay ({self.address}) in "
                     f"{self.ranks_wait_s:.0f} s: node 0 does not see this node's ranks yet")
        elif ranks_seen and self._said_no_ranks:
            self._said_no_ranks = False
            self.ranks_wait_s = float("inf")  # said once, and its end once
            self.say("this node's ranks reach its relay now")

    def close(self) -> None:
        """Before the watched sockets close: the upstream one lingers for the last batch,
        still reporting (descriptors.stop_monitor: else a relay that never exits)."""
        for sock, mon in zip(self._watched, (self._local, self._up), strict=True):
            stop_monitor(sock, mon)
