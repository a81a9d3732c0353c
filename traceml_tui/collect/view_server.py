"""The collector's view socket: viewers ask, the collector answers from frozen state.

Once per evaluation tick, when a viewer asks, the state is frozen into a `RunView`
(view_build.py) and encoded once; every viewer gets the same bytes until the next tick.
With no viewer attached (a headless or detached run) no view is built: ~8 ms a tick at
1,024 ranks, ~210 ms at 16,384, that nobody would read. A /metrics server reads the view
from its own thread, which may not touch the state: with one the view is built every
tick (`eager`). A viewer may also ask for one rank's
detail, a deep-trace capture, or the summary so far. Whatever a viewer sends, it gets
exactly one reply and can never end the record (tests/collect/test_properties.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq
from msgspec.structs import replace

from traceml_agent.protocol import encode_capture_request
from traceml_agent.requests import (
    CaptureReply,
    CaptureStart,
    ErrorReply,
    RequestError,
    ViewOp,
    ViewRequest,
    decode_view,
    encode_view,
)
from traceml_tui import viewmodel
from traceml_tui.judge.snapshot import Snapshot
from traceml_tui.judge.state import RunState
from traceml_tui.report import summary
from traceml_tui.runfolder import summary_model

from . import view_build
from .deep_traces import DeepTraceBoard, deep_trace_roles
from .ingest_pump import Route

# A "summary" (a viewer's `e` export, `traceml export`) costs a full snapshot: ~0.1 s at
# 1,024 ranks, ~1.4 s at 16,384. A fresh one is built at most once per this many times
# the last one's cost, and requests in between get its bytes: however many viewers ask,
# summaries take at most a tenth of the collector's core (as snapshot writes do).
SUMMARY_BACKOFF = 9.0


class ViewServer:
    """`sock`: the collector's REP view socket; `routes`: each rank's connection, shared
    with the collector's ingest; `send_to(route, frame)`: a request down a connection."""

    def __init__(self, sock: zmq.Socket, state: RunState, captures: DeepTraceBoard,
                 routes: dict[int, Route], send_to: Callable[[Route, bytes], None]) -> None:
        self.sock = sock
        self.state = state
        self.captures = captures
        self.routes = routes
        self.send_to = send_to
        self.snap: Snapshot | None = None
        self.now: viewmodel.RunView | None = None
        self.bytes = b""
        self.errors = 0  # requests whose handler failed (answered with an error)
        self._summary = b""  # the last summary's bytes, and when the next may be built
        self._summary_next = 0.0
        self.eager = False  # build every tick (a /metrics server reads `now` and `snap`)
        self.stale = True  # a tick has passed since the view was built
        self.spent = 0.0  # seconds of views built on request, not yet charged to a tick

    def refresh(self) -> None:
        """A new tick: the view is frozen again when a viewer next asks (now if eager,
        inside the tick, whose cost the collector already counts)."""
        self.stale = True
        if self.eager:
            self.build(charge=False)

    def build(self, charge: bool = True) -> None:
        """Freeze the state for viewers; every viewer gets the same bytes. A build asked
        by a viewer between ticks is charged to the next tick (`take_spent`): the
        collector spaces its ticks by their cost, views included, as when every tick
        built one (collector.EVAL_BACKOFF)."""
        start = time.monotonic()
        self.stale = False
        snap = self.state.snapshot(time.time(), start)
        self.snap = snap
        self.now = replace(view_build.build(snap, self.state.recent_steps),
                                capture=self.captures.view())
        self.bytes = viewmodel.encode_view(self.now)
        if charge:
            self.spent += time.monotonic() - start

    def take_spent(self) -> float:
        """Seconds spent building views for viewers since the last call."""
        spent, self.spent = self.spent, 0.0
        return spent

    def handle(self) -> None:
        """One view request, one reply. The request is decoded and validated by its Struct
        (requests.py); whatever a viewer sends, a bad request or a handler error becomes an
        error reply: a viewer (or any key holder) can never end the record."""
        try:
            request = decode_view(self.sock.recv())
        except RequestError as exc:
            self.sock.send(encode_view(ErrorReply(str(exc))))
            return
        try:
            self._answer(request)
        except Exception as exc:  # a bug, or a request no bound foresaw
            self.errors += 1
            try:
                self.sock.send(encode_view(ErrorReply(f"request failed: {type(exc).__name__}")))
            except zmq.ZMQError:  # the reply was already sent (REP state): nothing to do
                pass

    def _answer(self, request: ViewOp) -> None:
        if isinstance(request, ViewRequest):
            if self.stale:  # True until the first build
                self.build()
            pinned = request.rank
            extra = None
            if pinned is not None and self.snap is not None and self.now is not None:
                extra = view_build.detail(self.snap, pinned, self.now,
                                          self.state.recent_steps(pinned))
            self.sock.send_multipart([self.bytes, viewmodel.encode_detail(extra)])
        elif isinstance(request, CaptureStart):
            self.sock.send(encode_view(self.start_capture(request)))
        else:
            self.sock.send(self.summary_bytes())

    def summary_bytes(self) -> bytes:
        """The summary so far, built afresh at most every SUMMARY_BACKOFF times its cost."""
        start = time.monotonic()
        if not self._summary or start >= self._summary_next:
            snap = self.state.snapshot(time.time(), start, full=True)
            self._summary = summary_model.to_msgpack(
                summary.build(snap, summary.RunMeta(complete=False)))
            done = time.monotonic()
            self._summary_next = done + SUMMARY_BACKOFF * (done - start)
        return self._summary

    def start_capture(self, request: CaptureStart) -> CaptureReply:
        """A viewer asks for a deep trace: of the ranks it names (the pinned one; the median
        rank is added to compare with), else of the worst and the median rank."""
        if self.stale:
            self.build()
        roles = deep_trace_roles(self.now, request.ranks)
        roles = {r: role for r, role in roles.items() if r in self.routes}
        cap, error = self.captures.start(roles, request.steps)
        if cap is None:
            return CaptureReply(False, error)
        for rank in cap.ranks:
            self.send_to(self.routes[rank], encode_capture_request(cap.id, request.steps))
        return CaptureReply(True, id=cap.id, ranks=list(cap.ranks), steps=request.steps)
