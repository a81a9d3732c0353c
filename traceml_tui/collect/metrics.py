"""Prometheus metrics: the collector's view of the run at /metrics, for the fleet's
Prometheus and Grafana (`traceml run --metrics-port PORT`; docs/metrics.md).

A scrape reads the frozen view and snapshot the collector publishes once per evaluation
tick (view_server.py): it never touches the live state, never blocks ingest for longer
than building the text, and never writes anything. Cardinality is bounded: per-rank
series for every rank up to PER_RANK_ALL ranks; above that, for the diagnosis subject
and the PER_RANK_WORST ranks furthest from the median rank only, with per-node worst
values for every node (docs/metrics.md has the arithmetic).

The text is written here, in the Prometheus text format (the bytes prometheus_client's
generate_latest wrote for the same families: a test compares), once per published view
and served as those bytes to every scraper: ~3 ms at 1,024 ranks, where building a
prometheus_client object per sample took ~50 ms of the collector's GIL (issue 33).
"""

from __future__ import annotations

import heapq
import math
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from itertools import chain, repeat
from typing import Any

import msgspec
import numpy as np

from traceml_agent.vocab import MEMORY_HOST
from traceml_tui.judge.memory import worst_first
from traceml_tui.judge.snapshot import Snapshot
from traceml_tui.viewmodel import (
    VIEW_PHASES,
    RankRow,
    RunView,
    own_distance,
    own_work,
    subject_ranks,
)

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
    furthest from the median rank's (ties: the lower rank first)."""
    rows = [r for r in view.rows if r.step_ms is not None]
    if len(rows) <= PER_RANK_ALL:
        return rows
    # Unknown median: the own work itself (ranks that measured most first).
    far = own_distance(own_work(view.median_phase_ms) or 0.0)
    subject = subject_ranks(view)
    keep = sorted((r for r in rows if r.rank in subject), key=lambda r: (-far(r), r.rank))
    # nlargest is sorted(reverse=True)[:n]: stable, so rows of equal distance stay in
    # rank order, as a full sort by (-far, rank) had them, at a fraction of its cost.
    return keep + heapq.nlargest(PER_RANK_WORST, (r for r in rows if r.rank not in subject),
                                 key=far)


# A family's sample lines up to their values, by label values, kept from one render to the
# next: a rank's labels do not change from tick to tick, so a render formats only values.
# Bounded: a family's are dropped past this many (16,384 ranks x 9 series fit).
MAX_PREFIXES = 1 << 18
_PREFIXES: dict[tuple[str, ...], dict[Any, Any]] = {}


def _kept(*key: str) -> dict[Any, Any]:
    known = _PREFIXES.setdefault(key, {})
    if len(known) > MAX_PREFIXES:
        known.clear()
    return known


class Family:
    """One metric family's exposition, byte for byte as prometheus_client's generate_latest
    writes it (HELP, TYPE, then a line per sample with its labels sorted by name), without
    an object per sample: label sets are formatted once (and kept: _PREFIXES) and the
    values all at once. A counter's samples are named NAME_total."""

    __slots__ = ("head", "template", "base", "known", "prefixes", "values")

    def __init__(self, name: str, doc: str, base: dict[str, str],
                 labels: tuple[str, ...] | list[str] = (), kind: str = "gauge") -> None:
        sample = name + "_total" if kind == "counter" else name
        help_text = doc.replace("\\", r"\\").replace("\n", r"\n")
        self.head = f"# HELP {sample} {help_text}\n# TYPE {sample} {kind}\n"
        names = [*base, *labels]
        inner = ",".join(f'{names[i]}="{{{i}}}"'
                         for i in sorted(range(len(names)), key=names.__getitem__))
        self.template = sample + ("{{" + inner + "}}" if names else "") + " "
        self.base = tuple(base.values())
        self.known = _kept(self.template, *self.base)
        self.prefixes: list[str] = []
        self.values: list[float] = []

    def prefix(self, values: tuple[str, ...]) -> str:
        """A sample's line up to its value, for its own label values (after the job's)."""
        text = self.known.get(values)
        if text is None:
            text = self.known[values] = self.template.format(*map(_escape, self.base + values))
        return text

    def add(self, values: tuple[str, ...], value: float) -> None:
        self.prefixes.append(self.prefix(values))
        self.values.append(value)

    def text(self) -> str:
        floats = _go_floats(self.values)
        assert len(floats) == len(self.prefixes)
        return self.head + "".join(chain.from_iterable(zip(self.prefixes, floats,
                                                           repeat("\n"))))


def _escape(value: str) -> str:
    """A label value as the text format quotes it."""
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')
    return value


def _go_floats(values: list[float]) -> list[str]:
    """Sample values as prometheus_client writes them (Go's float formatting): the
    shortest digits that read back to the same float, as Python's repr writes them, all
    at once by msgspec's encoder (~0.08 us a value, where repr takes ~0.35 us: at 1,024
    ranks this was half a scrape's cost). msgspec writes the same digits but no exponent
    below 1e-4 (repr: 5e-05) and writes NaN and infinities as null: those few, and the
    large values Go writes otherwise, are formatted one by one (_go_float)."""
    if not values:
        return []
    array = np.asarray(values, dtype=np.float64)  # counts too: written as floats (12.0)
    floats = array.tolist()
    out = msgspec.json.encode(floats).decode()[1:-1].split(",")
    size = np.abs(array)
    for i in np.flatnonzero(~((size >= 1e-4) & (size < 1e6))).tolist():
        out[i] = _go_float(floats[i])
    return out


def _go_float(d: float) -> str:
    if d != d:
        return "NaN"
    if d in (math.inf, -math.inf):
        return "+Inf" if d > 0 else "-Inf"
    s = repr(d)
    dot = s.find(".")
    if d > 0 and dot > 6:  # Go switches to exponents sooner than Python
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return s


def render(view: RunView | None, snap: Snapshot | None, run_name: str) -> bytes:
    """The exposition text of a published view (empty before the first)."""
    if view is None:
        return b""
    base = {"job": run_name, **job_labels()}

    def gauge(name: str, doc: str, labels: tuple[str, ...] | list[str] = ()) -> Family:
        return Family(name, doc, base, labels)

    step = gauge("traceml_rank_step_seconds", "A rank's median step over its recent "
                 "steps.", ["rank", "node", "host"])
    phase = gauge("traceml_rank_phase_seconds", "A rank's median time per step in a "
                  "phase (sync: exposed collective wait).", ["rank", "node", "phase"])
    steps = Family("traceml_rank_steps", "Steps a rank has completed.", base,
                   ["rank", "node"], kind="counter")
    # Rank rows are most of the text: their three families' label sets kept per rank.
    known = _kept("ranks", step.template, *step.base)
    step_ms: list[float] = []
    phase_lines: list[str] = []
    phase_ms: list[float | None] = []
    exported = ranks_to_export(view)
    for r in exported:
        pre = known.get((r.rank, r.node, r.host))
        if pre is None:
            rank, node = str(r.rank), str(r.node)
            pre = known[(r.rank, r.node, r.host)] = (
                step.prefix((rank, node, r.host)),
                [phase.prefix((rank, node, name)) for name in VIEW_PHASES],
                steps.prefix((rank, node)))
        if r.step_ms is not None:
            step.prefixes.append(pre[0])
            step_ms.append(r.step_ms)
        phase_lines += pre[1]
        phase_ms += r.phase_ms
        steps.prefixes.append(pre[2])
        steps.values.append(r.steps)
    step.values = [v / 1000.0 for v in step_ms]
    phase.prefixes = [line for line, v in zip(phase_lines, phase_ms, strict=True)
                      if v is not None]
    phase.values = [v / 1000.0 for v in phase_ms if v is not None]
    out = [step, phase, steps]

    node_step = gauge("traceml_node_worst_step_seconds", "The slowest median step of "
                      "a node's ranks (every node, whatever the scale).", ["node", "host"])
    for _, row in view.node_rows or _nodes(view):
        if row.step_ms is not None:
            node_step.add((str(row.node), row.host), row.step_ms / 1000.0)
    out.append(node_step)

    job = gauge("traceml_job_step_seconds", "The median rank's step.")
    if view.median_step_ms is not None:
        job.add((), view.median_step_ms / 1000.0)
    total = Family("traceml_job_steps", "Steps of the furthest rank.", base, kind="counter")
    total.add((), float(view.steps))
    world = gauge("traceml_world_size", "Ranks the job was started with.")
    world.add((), float(view.world_size))
    out += [job, total, world]

    diag = gauge("traceml_diagnosis_info", "The live diagnosis (value 1): its label, "
                 "the rank or node it names, its severity.",
                 ["label", "rank", "node", "severity", "phase"])
    node = "" if view.node is None else str(view.node)
    if view.node is None and view.rank is not None and view.rank < len(view.rows):
        node = str(view.rows[view.rank].node)
    diag.add((view.label, "" if view.rank is None else str(view.rank), node, view.severity,
              view.phase or ""), 1.0)
    out.append(diag)
    out += _cost(view, gauge)

    status = gauge("traceml_ranks", "Ranks by state (ok, stale, failed, done, ...).",
                   ["state"])
    counts: dict[str, int] = {}
    for r in view.rows:
        counts[r.status] = counts.get(r.status, 0) + 1
    for name, n in sorted(counts.items()):
        status.add((name,), float(n))
    out.append(status)

    checks = gauge("traceml_setup_check_ranks", "Ranks a setup check found a mistake "
                   "on (docs/checks.md).", ["check", "severity"])
    for check_id, severity, ranks, _evidence, _fix in view.checks:
        checks.add((check_id, severity), float(len(ranks)))
    out.append(checks)

    if snap is not None:
        out += _memory(view, snap, None if len(view.rows) <= PER_RANK_ALL
                       else {r.rank for r in exported}, gauge)
        counters = Family("traceml_collector_messages", "The collector's ingest counters "
                          "(dropped: agent_dropped, malformed, ...).", base, ["kind"],
                          kind="counter")
        for name, n in sorted(snap.counters.items()):
            counters.add((name,), float(n))
        out.append(counters)
    return "".join(f.text() for f in out).encode()


# Growing ranks with a growth series, fastest first (report/memory_report.py lists as many).
MEMORY_GROWING_EXPORTED = 32


def _memory(view: RunView, snap: Snapshot, exported: set[int] | None,
            gauge: Callable[..., Family]) -> list[Family]:
    """Each rank's memory (past PER_RANK_ALL ranks, the `exported` ones'), and the
    growing ranks' rate and time left to the limit (judge/memory.py; docs/diagnosis.md,
    "Memory growth")."""
    rss = gauge("traceml_rank_rss_bytes", "A rank's host resident memory, latest sample.",
                ["rank", "node"])
    gpu = gauge("traceml_rank_gpu_memory_bytes", "A rank's GPU memory, latest sample: "
                "torch's allocated, else NVML's used.", ["rank", "node"])
    nodes = {r.rank: r.node for r in view.rows}
    for t in snap.memory:
        if exported is not None and t.rank not in exported:
            continue
        labels = (str(t.rank), str(nodes.get(t.rank, "")))
        if t.rss_mb is not None:
            rss.add(labels, t.rss_mb * 2**20)
        if t.gpu_mb is not None:
            gpu.add(labels, t.gpu_mb * 2**20)
    rate = gauge("traceml_rank_memory_growth_bytes_per_second", "A rank's memory growth "
                 "rate, for ranks whose memory rises steadily after warm-up.",
                 ["rank", "node", "memory"])
    left = gauge("traceml_rank_memory_limit_seconds", "Time left before a growing rank's "
                 "memory reaches its limit at its rate (cgroup, host or GPU).",
                 ["rank", "node", "memory"])
    growing = sorted((t for t in snap.memory if t.growing), key=worst_first)
    for t in growing[:MEMORY_GROWING_EXPORTED]:
        which = (str(t.rank), str(nodes.get(t.rank, "")), t.growing or "")
        per_min = t.rss_rate_mb_min if t.growing == MEMORY_HOST else t.gpu_rate_mb_min
        rate.add(which, (per_min or 0.0) * 2**20 / 60.0)
        if t.limit_in_s is not None:
            left.add(which, t.limit_in_s)
    return [rss, gpu, rate, left]


def _cost(view: RunView, gauge: Callable[..., Family]) -> list[Family]:
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
        share.add((), c.share)
        whatif.add((), c.step_ms / 1000.0)
        if c.lost_s is not None:
            lost.add((), c.lost_s)
        if c.hours is not None:
            hours.add((c.unit,), c.hours)
    return [share, lost, hours, whatif]


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
# Connections the kernel completes before we accept them. Past the queue a client's SYN is
# dropped and retried 1, 3, 7, 15, 31, 63 s later: in a flood of idle connections, with
# this thread slow to accept (the collector busy), a real scrape waited that long, and a
# flood took minutes to drain (fresh-clone CI: 364 of 400 idle connections capped and
# counted after 90 s). Held by the kernel, they cost no descriptor until accepted.
BACKLOG = 1024


class MetricsServer(threading.Thread):
    """/metrics on one thread with a selector: every scraper gets the same bytes, rendered
    once per published view (the collector's tick), however many scrape and however often;
    connections are capped (MAX_CONNECTIONS) and timed out (CONNECTION_TIMEOUT_S).
    `refused` and `timed_out` count the connections it closed."""

    def __init__(self, source: Source, run_name: str, host: str, port: int) -> None:
        super().__init__(name="traceml-metrics", daemon=True)
        self.source = source
        self.run_name = run_name
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        self.listener = socket.socket(family, kind, proto)
        try:
            self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.listener.bind(addr)
            self.listener.listen(BACKLOG)
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
        """The text for the current view: rendered on its first scrape, then the same
        bytes for every scrape until the collector publishes the next tick's view."""
        view, snap = self.source()
        if view is None or view is not self._view:
            self._body = render(view, snap, self.run_name)
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
