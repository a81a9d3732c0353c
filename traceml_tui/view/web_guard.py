"""The browser view's connections before they are the owner's (issue 42, item 5).

The lock (web_lock.py) checks a request once its headers are in; aiohttp gives headers no
deadline. So another local user, with no token, held ~1,000 connections that each sent a
request line and stopped: every descriptor of the server's soft limit was taken, the
owner's URL timed out, and asyncio logged a traceback per failed accept (a million lines in
40 s on the owner's terminal). So, as the collector's ports are:

- the soft descriptor limit goes up to the hard one at start (`raise_limit`);
- a connection has HEADER_DEADLINE_S to send a request the lock lets through, then it is
  closed; at most MAX_PENDING such connections are held, the oldest closed for each new
  one, half a second later (a real browser sends its request within milliseconds of
  connecting);
- a refused request's connection is closed after its one-line answer (web_lock.py);
- accept errors (out of descriptors) are counted and said at powers of two, like the
  lock's refusals, instead of asyncio's traceback each time.
"""

from __future__ import annotations

import asyncio
import errno
import resource
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from aiohttp import web

# A browser sends its request as soon as it is connected; a connection that has sent no
# request the lock lets through after this long is closed.
HEADER_DEADLINE_S = 5.0
# Connections held that have not yet sent such a request (an owner's tab opens ~6).
MAX_PENDING = 64
# Past the cap, the oldest are closed this long after: asyncio accepts connections in
# bursts (up to its backlog) before it reads any, so closing at once would close an owner's
# connection accepted amid a flood before its request, already sent, was read.
TRIM_DELAY_S = 0.5
# The soft limit raised to at most this (a hard limit may be "unlimited").
MAX_SOFT_LIMIT = 1 << 20
OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def raise_limit() -> tuple[int, int]:
    """The soft descriptor limit raised to the hard one; returns (soft, hard) after.
    (The collector's own, collect/descriptors.py, is a layer above the view.)"""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = MAX_SOFT_LIMIT if hard == resource.RLIM_INFINITY else min(hard, MAX_SOFT_LIMIT)
    if want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft, hard


class ConnectionGuard:
    """Deadlines and a cap on connections not yet admitted; `count(kind)` says refusals
    (WebLock.count: counted, said at powers of two, totalled at exit)."""

    def __init__(self, count: Callable[[str], None],
                 deadline_s: float = HEADER_DEADLINE_S, max_pending: int = MAX_PENDING) -> None:
        self.count = count
        self.deadline_s = deadline_s
        self.max_pending = max_pending
        # Per connection (aiohttp's handler): its transport and its deadline.
        self.pending: OrderedDict[Any, tuple[asyncio.Transport, asyncio.TimerHandle]] = (
            OrderedDict())
        self._trim: asyncio.TimerHandle | None = None

    def watch(self, server: web.Server) -> web.Server:
        """aiohttp's protocol factory (the runner's web.Server), each of its connections
        watched: the server's own hooks, called by every connection it makes."""
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler: Any, transport: asyncio.Transport) -> None:
            made(handler, transport)
            self._opened(handler, transport)

        def connection_lost(handler: Any, exc: BaseException | None = None) -> None:
            self._forget(handler)
            lost(handler, exc)

        setattr(server, "connection_made", connection_made)  # noqa: B010 (this instance's)
        setattr(server, "connection_lost", connection_lost)  # noqa: B010
        return server

    def _opened(self, handler: Any, transport: asyncio.Transport) -> None:
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self.deadline_s, self._expire, handler)
        self.pending[handler] = (transport, timer)
        if len(self.pending) > self.max_pending and self._trim is None:
            self._trim = loop.call_later(TRIM_DELAY_S, self._trim_pending)

    def _trim_pending(self) -> None:
        """The oldest connections without a request, closed down to the cap."""
        self._trim = None
        while len(self.pending) > self.max_pending:
            _, (transport, timer) = self.pending.popitem(last=False)
            timer.cancel()
            self.count("crowded")
            transport.abort()

    def _expire(self, handler: Any) -> None:
        entry = self.pending.pop(handler, None)
        if entry is not None:
            self.count("stalled")
            entry[0].abort()

    def _forget(self, handler: Any) -> None:
        entry = self.pending.pop(handler, None)
        if entry is not None:
            entry[1].cancel()

    def admit(self, request: web.Request) -> None:
        """The lock let this request through: its connection is the owner's."""
        self._forget(request.protocol)

    def on_loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """asyncio's exception handler: a failed accept is counted, not a traceback."""
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in OUT_OF_RESOURCES:
            self.count("accept")
            return
        loop.default_exception_handler(context)
