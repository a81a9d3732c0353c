"""Prometheus metrics: the collector's view of the run at /metrics, for the fleet's
Prometheus and Grafana (`traceml run --metrics-port PORT`; docs/metrics.md).

A scrape reads the frozen view and snapshot the collector publishes once per evaluation
tick (view_server.py): it never touches the live state, never blocks ingest for longer
than building the text, and never writes anything. Cardinality is bounded: per-rank
series for every rank up to PER_RANK_ALL ranks; above that, for the diagnosis subject
and the PER_RANK_WORST ranks furthest from the median rank only, with per-node worst
values for every node (docs/metrics.md has the arithmetic).
"""

from __future__ import annotations

import os
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from traceml_tui.judge.state import Snapshot
from traceml_tui.viewmodel import VIEW_PHASES, RankRow, RunView, own_work

# Every rank gets its own series up to this many ranks (8 phase series + 2 per rank:
# ~10k series at 1,024 ranks, what one Prometheus takes per job without notice) ...
PER_RANK_ALL = 1024
# ... and above it only the subject and the ranks furthest from the median rank do.
PER_RANK_WORST = 64

Source = Callable[[], tuple[RunView | None, Snapshot | None]]


def job_labels() -> dict[str, str]:
    """Labels that tie the series to the scheduler's job, as NCCL Inspector's exporter
    does (slurm_job_id under Slurm)."""
    job = os.environ.get("SLURM_JOB_ID")
    return {"slurm_job_id": job} if job else {}


def ranks_to_export(view: RunView) -> list[RankRow]:
    """Every rank, or (past PER_RANK_ALL) the subject and the ranks whose own work is
    furthest from the median rank's."""
    rows = [r for r in view.rows if r.step_ms is not None]
    if len(rows) <= PER_RANK_ALL:
        return rows
    mid = own_work(view.median_phase_ms) or 0.0

    def far(r: RankRow) -> float:
        own = own_work(r.phase_ms)
        return 0.0 if own is None else abs(own - mid)

    subject = {view.rank} if view.node is None else {r.rank for r in rows if r.node == view.node}
    ranked = sorted(rows, key=lambda r: (r.rank not in subject, -far(r), r.rank))
    keep = [r for r in ranked if r.rank in subject]
    return keep + [r for r in ranked if r.rank not in subject][:PER_RANK_WORST]


class RunMetrics(Collector):
    """A prometheus_client collector over the latest published view."""

    def __init__(self, source: Source, run_name: str) -> None:
        self.source = source
        self.run_name = run_name

    def describe(self) -> list[Metric]:
        return []  # no fixed set: the registry must not call collect() at registration

    def collect(self) -> Iterator[Metric]:
        view, snap = self.source()
        if view is None:
            return
        base = {"job": self.run_name, **job_labels()}
        keys, values = list(base), list(base.values())

        def gauge(name: str, doc: str, labels: tuple[str, ...] | list[str] = ()
                  ) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=keys + list(labels))

        step = gauge("traceml_rank_step_seconds", "A rank's median step over its recent "
                     "steps.", ["rank", "node", "host"])
        phase = gauge("traceml_rank_phase_seconds", "A rank's median time per step in a "
                      "phase (sync: exposed collective wait).", ["rank", "node", "phase"])
        steps = CounterMetricFamily("traceml_rank_steps", "Steps a rank has completed.",
                                    labels=keys + ["rank", "node"])
        for r in ranks_to_export(view):
            rank, node = str(r.rank), str(r.node)
            if r.step_ms is not None:
                step.add_metric(values + [rank, node, r.host], r.step_ms / 1000.0)
            for name, v in zip(VIEW_PHASES, r.phase_ms, strict=True):
                if v is not None:
                    phase.add_metric(values + [rank, node, name], v / 1000.0)
            steps.add_metric(values + [rank, node], float(r.steps))
        yield step
        yield phase
        yield steps

        node_step = gauge("traceml_node_worst_step_seconds", "The slowest median step of "
                          "a node's ranks (every node, whatever the scale).", ["node", "host"])
        for _, row in view.node_rows or _nodes(view):
            if row.step_ms is not None:
                node_step.add_metric(values + [str(row.node), row.host], row.step_ms / 1000.0)
        yield node_step

        job = gauge("traceml_job_step_seconds", "The median rank's step.")
        if view.median_step_ms is not None:
            job.add_metric(values, view.median_step_ms / 1000.0)
        yield job
        total = CounterMetricFamily("traceml_job_steps", "Steps of the furthest rank.",
                                    labels=keys)
        total.add_metric(values, float(view.steps))
        yield total
        world = gauge("traceml_world_size", "Ranks the job was started with.")
        world.add_metric(values, float(view.world_size))
        yield world

        diag = gauge("traceml_diagnosis_info", "The live diagnosis (value 1): its label, "
                     "the rank or node it names, its severity.",
                     ["label", "rank", "node", "severity", "phase"])
        node = "" if view.node is None else str(view.node)
        if view.node is None and view.rank is not None and view.rank < len(view.rows):
            node = str(view.rows[view.rank].node)
        diag.add_metric(values + [view.label, "" if view.rank is None else str(view.rank),
                                  node, view.severity, view.phase or ""], 1.0)
        yield diag
        yield from _cost(view, gauge, values)

        status = gauge("traceml_ranks", "Ranks by state (ok, stale, failed, done, ...).",
                       ["state"])
        counts: dict[str, int] = {}
        for r in view.rows:
            counts[r.status] = counts.get(r.status, 0) + 1
        for name, n in sorted(counts.items()):
            status.add_metric(values + [name], float(n))
        yield status

        checks = gauge("traceml_setup_check_ranks", "Ranks a setup check found a mistake "
                       "on (docs/checks.md).", ["check", "severity"])
        for check_id, severity, ranks, _evidence, _fix in view.checks:
            checks.add_metric(values + [check_id, severity], float(len(ranks)))
        yield checks

        if snap is not None:
            counters = CounterMetricFamily("traceml_collector_messages", "The collector's "
                                           "ingest counters (dropped: agent_dropped, "
                                           "malformed, ...).", labels=keys + ["kind"])
            for name, n in sorted(snap.counters.items()):
                counters.add_metric(values + [name], float(n))
            yield counters


def _cost(view: RunView, gauge: Callable[..., GaugeMetricFamily], values: list[str]
          ) -> Iterator[Metric]:
    c = view.cost
    share = gauge("traceml_cost_step_share", "Share of every step the diagnosed problem "
                  "costs (cost.py).")
    lost = gauge("traceml_cost_lost_seconds", "Job seconds the diagnosed problem cost so "
                 "far.")
    hours = gauge("traceml_cost_device_hours", "lost seconds x world size / 3600 (GPU-hours "
                  "on GPU jobs, rank-hours on CPU jobs).", ["unit"])
    whatif = gauge("traceml_whatif_step_seconds", "The step the job would have without the "
                   "diagnosed problem.")
    if c is not None:
        share.add_metric(values, c.share)
        whatif.add_metric(values, c.step_ms / 1000.0)
        if c.lost_s is not None:
            lost.add_metric(values, c.lost_s)
        if c.hours is not None:
            hours.add_metric(values + [c.unit], c.hours)
    yield from (share, lost, hours, whatif)


def _nodes(view: RunView) -> list[tuple[int, RankRow]]:
    from traceml_tui.viewmodel import node_rows

    return list(node_rows(view.rows))


# --- the HTTP server: one thread, bounded -------------------------------------------------

# Open scrape connections at once: a Prometheus (or two, in HA pairs) holds one; past this
# the oldest one that has not sent its request is closed (counted), so idle connections
# can neither take the collector's descriptors (~970 idle connections once exhausted them:
# one thread and one descriptor each, no timeout) nor keep a real scrape out.
MAX_CONNECTIONS = 32
# A connection must send its request and take its reply within this: an idle or
# trickling one is closed (counted). A real scrape takes milliseconds on loopback.
CONNECTION_TIMEOUT_S = 5.0
ACCEPT_BACKOFF_S = 0.25  # out of descriptors, accept again after this (never spin)
MAX_REQUEST_BYTES = 8 << 10  # the request line and headers of a scrape: a few hundred bytes
CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"


class MetricsServer(threading.Thread):
    """/metrics on one thread with a selector: every scraper gets the same bytes, rendered
    once per published view (the collector's tick), however many scrape and however often;
    connections are capped (MAX_CONNECTIONS) and timed out (CONNECTION_TIMEOUT_S).
    `refused` and `timed_out` count the connections it closed."""

    def __init__(self, source: Source, run_name: str, host: str, port: int) -> None:
        super().__init__(name="traceml-metrics", daemon=True)
        self.source = source
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(RunMetrics(source, run_name))
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        self.listener = socket.socket(family, kind, proto)
        try:
            self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.listener.bind(addr)
            self.listener.listen(128)
        except OSError:
            self.listener.close()
            raise
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.refused = 0
        self.timed_out = 0
        self.renders = 0
        self._view: object = None  # the view the cached exposition was rendered from
        self._body = b""
        self._halt = threading.Event()
        self._listen_after = 0.0  # out of descriptors: accept again from then on

    def exposition(self) -> bytes:
        """The text for the current view: rendered on its first scrape, then reused."""
        view, _ = self.source()
        if view is None or view is not self._view:
            self._body = generate_latest(self.registry)
            self._view = view
            self.renders += 1
        return self._body

    def _reply(self, request: bytes) -> bytes:
        line = request.split(b"\r\n", 1)[0].split()
        if len(line) >= 2 and line[0] in (b"GET", b"HEAD") and line[1].split(b"?")[0] in (
                b"/metrics", b"/"):
            body = self.exposition()
            head = (b"HTTP/1.1 200 OK\r\nContent-Type: " + CONTENT_TYPE
                    + b"\r\nContent-Length: " + str(len(body)).encode()
                    + b"\r\nConnection: close\r\n\r\n")
            return head if line[0] == b"HEAD" else head + body
        return b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"

    def run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ, None)
        conns: dict[socket.socket, _Conn] = {}

        def close(sock: socket.socket) -> None:
            sel.unregister(sock)
            sock.close()
            del conns[sock]

        try:
            while not self._halt.is_set():
                for key, _ in sel.select(0.25):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    if sock is self.listener:
                        self._accept(sel, conns)
                        continue
                    conn = conns.get(sock)
                    if conn is None:
                        continue
                    if not conn.step(sock, self._reply):
                        close(sock)
                    elif conn.reply is not None and key.events != selectors.EVENT_WRITE:
                        sel.modify(sock, selectors.EVENT_WRITE, None)  # the rest of the reply
                now = time.monotonic()
                if self._listen_after and now >= self._listen_after:
                    self._listen_after = 0.0
                    sel.register(self.listener, selectors.EVENT_READ, None)
                for sock in [s for s, c in conns.items() if c.deadline < now]:
                    self.timed_out += 1
                    close(sock)
        finally:
            for sock in list(conns):
                sock.close()
            self.listener.close()
            sel.close()

    def _accept(self, sel: selectors.BaseSelector, conns: dict[socket.socket, _Conn]) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors: leave the rest in the kernel's backlog
                self._listen_after = time.monotonic() + ACCEPT_BACKOFF_S  # and do not spin
                sel.unregister(self.listener)
                return
            if len(conns) >= MAX_CONNECTIONS:
                # The oldest connection still silent makes room: idle connections held
                # open cannot keep a real scrape (its request comes within a ms) out.
                oldest = next((s for s, c in conns.items() if c.reply is None), None)
                self.refused += 1
                if oldest is None:  # every one is being answered
                    sock.close()
                    continue
                sel.unregister(oldest)
                oldest.close()
                del conns[oldest]
            sock.setblocking(False)
            conns[sock] = _Conn(time.monotonic() + CONNECTION_TIMEOUT_S)
            sel.register(sock, selectors.EVENT_READ, None)

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(5)


class _Conn:
    """One scrape: its request read, then its reply written, before its deadline."""

    __slots__ = ("deadline", "request", "reply")

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.request = b""
        self.reply: memoryview | None = None

    def step(self, sock: socket.socket, reply: Callable[[bytes], bytes]) -> bool:
        """Read or write what the socket allows; False when the connection is done."""
        try:
            if self.reply is None:
                data = sock.recv(4096)
                if not data:
                    return False
                self.request += data
                if b"\r\n\r\n" not in self.request:
                    return len(self.request) <= MAX_REQUEST_BYTES
                self.reply = memoryview(reply(self.request))
            sent = sock.send(self.reply)
            self.reply = self.reply[sent:]
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False
        return len(self.reply) > 0


def serve(source: Source, run_name: str, host: str, port: int) -> MetricsServer:
    """Start the /metrics HTTP server on its thread; returns it."""
    server = MetricsServer(source, run_name, host, port)
    server.start()
    return server
