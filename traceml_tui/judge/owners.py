"""Who may write a rank's record: the rule that keeps a key holder (the run's secret is in
every rank) from continuing, replacing or erasing another process's record.

A rank's record belongs to the process that started it, on its connection. That process,
reconnected, proves itself with its key (protocol.Hello.key: a pid is public). Another
process takes a rank over only once the rank said goodbye, or with a hello that names a
newer attempt (torchrun restarted the group) once the old connection is quiet: a quiet
rank is never continued by another process, for a rank stuck in a C call goes quiet too,
and its record must keep its hang (docs/security.md). No I/O, no clock: `now` is given.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Protocol

from traceml_agent.protocol import Hello, Identity, Message

# A rank whose connection said nothing for this long is quiet: its own process, back on
# another connection without a key, may continue it (a rank sends a heartbeat a second).
RANK_QUIET_S = 3.0


class Owned(Protocol):
    """What the rule reads of a rank's record (ingest.RankState)."""

    ident: Identity
    key: str | None
    finished: bool
    last_seen: float
    attempt: int  # the attempt its process belongs to (1-based)


class Owners:
    """The ownership of every rank's record: the job's processes (`of_the_job`, where the
    collector can tell) and the claims of other connections on ranks alive elsewhere."""

    def __init__(self, nnodes: int) -> None:
        self.nnodes = nnodes
        # Whether a pid is one of the job's processes (collect/lineage.py), set by the
        # collector where it can tell: a key holder's hello with a pid of its own then
        # cannot take a rank before the real one says hello (of_job).
        self.of_the_job: Callable[[int], bool] | None = None
        # A hello for a live rank from another connection: that connection may take the
        # rank over once the rank's own has gone quiet (one claim per rank: the newest
        # that could succeed): (its connection, pid, whether its hello named a newer
        # attempt than the rank's record).
        self.claims: dict[int, tuple[object, int, bool]] = {}

    def of_job(self, ident: Identity, conn: object) -> bool:
        """Whether a new process for a rank may have a record: where the collector can
        see the process (`of_the_job`: /proc's lineage), it must be one the launcher
        started. Only for ranks of this host, on a connection of their own (not through
        another node's relay); elsewhere the kernel that knows is another host's. Without
        the check (tests, offline use) every process may."""
        check = self.of_the_job
        if check is None or conn is None:
            return True
        relayed = isinstance(conn, tuple) and len(conn) == 2 and conn[1] is not None
        if relayed or (ident.node != 0 and self.nnodes > 1):
            return True
        return check(ident.pid)

    def may_take_over(self, rs: Owned, msg: Message, now: float, conn: object) -> bool:
        """A message for a rank that reports on another connection (module docstring).
        While the rank is alive every such message is refused: a key holder cannot
        replace it. A hello's attempt is compared with the rank's own record's, not the
        run's: the restarted group's other ranks may have opened the new attempt first
        (a rank killed without a goodbye is then still in the old one)."""
        rank, pid = msg.ident.rank, msg.ident.pid
        quiet = rs.finished or now - rs.last_seen >= RANK_QUIET_S
        if rs.ident.pid == pid:
            if rs.key is not None:
                key = getattr(msg.body, "key", None)
                return key is not None and hmac.compare_digest(key, rs.key)
            return quiet
        body = msg.body
        if isinstance(body, Hello) and self.of_job(msg.ident, conn):
            newer = body.attempt is not None and body.attempt + 1 > rs.attempt
            held = self.claims.get(rank)
            # A claim that can never succeed (the rank lives and the hello names no newer
            # attempt) does not displace one that can: a stale hello erases no restart.
            if newer or rs.finished or held is None or not held[2]:
                self.claims[rank] = (conn, pid, newer)
        claim = self.claims.get(rank)
        if claim is None or claim[:2] != (conn, pid):
            return False
        return rs.finished or (claim[2] and quiet)

    def forget(self, rank: int) -> None:
        """A new process has the rank's record: the claims on the old one go."""
        self.claims.pop(rank, None)
