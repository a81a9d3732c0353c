"""The collector: its own process, ingesting every rank's messages over ZeroMQ.

Sockets (addresses are written to RUN_DIR/collector.json once bound):
  ingest   ROUTER, where every agent's DEALER connects. Loopback unless told otherwise.
  control  REP on loopback, for the launcher: "ping", and "finish" (drain the ranks'
           last messages, write final_summary.json, reply with the job's exit code).
  view     REP on loopback, for dashboards (any number): "view" returns the frozen
           RunView of the last tick (encoded once, shared by all viewers) and the
           detail of the viewer's pinned rank; "summary" returns a summary document
           of the current state (for snapshot export). Viewers only read: a viewer
           that hangs or crashes never touches the job or the record (view_server.py).

Its parts: the ingest pump owns the ingest socket (ingest_pump.py), RunState keeps and
judges the ranks' records (judge/state.py), the view server answers viewers, the deep
trace board runs deep traces (deep_traces.py); this module binds the sockets, schedules the
ticks and writes the record at the end.

Every few seconds it rewrites RUN_DIR/live_snapshot.json atomically (the same
shape as the final summary, marked incomplete), so the record survives even if
this process is killed. Run it directly with `traceml collector` to collect from
scripts that call `traceml_agent.init()` themselves.
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import zmq
from msgspec.structs import replace

from traceml_agent import keys
from traceml_agent.protocol import (
    BEAT_MARK,
    MAX_RELAY_BATCH_BYTES,
    RELAY_SELF_ROUTE,
    RELAY_STACKS_TAG,
    RELAY_TAG,
    SYS_MARK,
    Capture,
    Heartbeat,
    Message,
    ProtocolError,
    RelayStackRequest,
    RelayStacks,
    StepRow,
    Steps,
    Sys,
    decode,
    decode_relay_batch,
    decode_relay_stacks,
    decode_wire,
    encode_relay_stacks,
    message,
    relayed_ok,
)
from traceml_agent.requests import (
    LAUNCHER_OPS,
    ControlReply,
    Finish,
    NativeStack,
    Ping,
    RequestError,
    decode_control,
    encode_reply,
)
from traceml_agent.transport import send_interval_s
from traceml_tui.judge import ingest_columns as columns
from traceml_tui.judge.state import RunState
from traceml_tui.report import ending, summary
from traceml_tui.runfolder import exit_codes, folders
from traceml_tui.runfolder.layout import RunFolder
from traceml_tui.runfolder.step_log import StepLogWriter

from . import descriptors, steps_columns
from .auth import start_authenticator
from .connections import EVENTS as CONNECTION_EVENTS
from .connections import ZAP_DOMAIN as INGEST_ZAP_DOMAIN
from .connections import ConnectionCap, cap_for
from .deep_traces import DeepTraceBoard
from .ingest_pump import IngestPump, Route
from .lineage import JobLineage
from .view_server import ViewServer

EVAL_INTERVAL_S = 0.5  # live diagnosis cadence: a change shows within ~1-2 s
# With thousands of ranks one evaluation (diagnosis + the viewers' frozen state, built
# when a viewer asks: view_server.py) costs tens of ms at 4,096 ranks and ~150 ms at
# 16,384 (benchmarks/README.md): ticks are spaced at least this many times their cost
# apart, so they never take more than a tenth of the collector's core from ingest, as
# the live file (SNAPSHOT_BACKOFF). Below ~4,000 ranks an evaluation costs less than a
# tenth of its interval and this changes nothing; at 16,384 a change shows ~1.5 s after
# its batch instead of ~1 s (a fifth, 5.0, until 2026-11-29: 14 % of a core there).
EVAL_BACKOFF = 9.0
SNAPSHOT_INTERVAL_S = 2.0  # how much a crash of this process can lose, at most
FINISH_GRACE_S = 3.0  # at the end, how long to wait for ranks' last batches
# With several nodes, other nodes' ranks end on their own clock (their torchrun may still
# be tearing down when ours returns): wait longer for their goodbyes, and call a rank
# gone only after missing its 1 s heartbeat more than twice.
FINISH_GRACE_MULTINODE_S = 10.0
QUIET_S, QUIET_MULTINODE_S = 0.5, 2.5
DRAIN_BATCH = 5_000  # messages taken per loop turn before looking at the clock
DRAIN_SLICE_S = 0.05  # ... or this long, so ticks and control requests are never starved
# ... taken from the queue at most this many bytes at a time, so the slice is looked at
# again after at most that much decoding (about 10 ms of 1 MiB steps messages).
DRAIN_TAKE_BYTES = 1 << 20
# A snapshot write may take a while with thousands of ranks: the next one waits at least
# this many times as long as the last took, so writing never takes more than a tenth of
# the core from ingest (16,384 ranks: ~1.4 s a write, one every ~15 s; 1,024: every 2 s).
SNAPSHOT_BACKOFF = 9.0
# The live file's whole-window part (every rank's window sorted per series, the verdict
# over it, its cost: about half a write) is recomputed at most this often; the counters,
# steps, live verdict and timeline every write. A window is hundreds of steps: its
# quantiles barely move in 10 s, and the file says when they were taken
# (run.window_stats_at). The final record's is always fresh.
WINDOW_REFRESH_S = 10.0
# Messages queued inside ZeroMQ for the collector cost up to one 8 KiB receive buffer each
# (measured: 1,024 peers x 100 queued 170-byte messages held 643 MiB), and the limit is per
# connection. So the per-connection limit comes from a total budget: past it, messages
# wait in the agents' own bounded queues (which drop and count), not in our memory.
RECV_BACKLOG_BYTES = 64 << 20
QUEUED_MESSAGE_BYTES = 8 << 10
MIN_RECV_HWM = 8
# ... and never more than this many per connection: a key holder's frames may be 1 MiB
# each, and while the ingest pump waits for the GIL (a long decode on the main thread)
# libzmq keeps filling the pipe up to the limit: at 2,048 (the budget's figure for a
# 4-rank run) four flooding connections took the collector to +1.9 GiB; at 16, +130 MiB.
# 16 messages is over a second of an agent's traffic; the pump empties pipes in ms.
MAX_RECV_HWM = 16
# Frames above this are refused by libzmq at the header: one message of the protocol's
# largest size in a relay's batch, plus room for the envelope.
TRANSPORT_FRAME_LIMIT = MAX_RELAY_BATCH_BYTES + 1024
LOOPBACK = ("127.0.0.1", "localhost", "::1")


# Control requests only the launcher may make (requests.LAUNCHER_OPS): with
# --control-key-stdin they must carry the key it wrote to our stdin (never in an
# environment, argument or file a rank sees).
CONTROL_KEY_CHARS = 64


MAX_STACK_ASKS = 64  # culprits of one hang whose stacks are asked of their relays


# glibc raises its mmap threshold to the size of each large block freed (up to 32 MiB):
# the live file's and the evaluation's temporaries of several MiB at 16,384 ranks then
# come from the heap, which keeps its high-water mark. A fixed threshold (mallopt) keeps
# those mapped, and unmapped when freed: a 10-minute soak at 16,384 ranks grew +4.3 % from
# minute 2 (506.6 -> 528.2 MiB) with the dynamic one; fixed at 128 KiB it ended 3 % below
# minute 2 (405.7 -> 393.3), but each evaluation took twice as long (every array of a
# rank each mapped afresh). At 4 MiB only the blocks past a few MiB are mapped.
MMAP_THRESHOLD_BYTES = 4 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def fix_mmap_threshold() -> bool:
    """Large allocations always mapped (above); False where the C library is not glibc."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):
        return False


def eval_interval_s(world_size: int) -> float:
    """Seconds between live evaluations at least: EVAL_INTERVAL_S, or the agents' send
    interval where it is longer (agent/transport.send_interval_s: past ~2,500 ranks a rank
    sends its steps every 0.5-1 s). A rank's window changes once per send interval, and an
    evaluation costs the same whatever changed: more than one per interval judges mostly
    the same windows again. (At 16,384 ranks an evaluation costs ~150 ms, which
    EVAL_BACKOFF spaces ~1.5 s apart: this floor matters once it is cheaper.) A change
    then shows within a batch interval and one more."""
    return max(EVAL_INTERVAL_S, send_interval_s(world_size))


def recv_hwm(world_size: int) -> int:
    return min(MAX_RECV_HWM, max(MIN_RECV_HWM,
                                 RECV_BACKLOG_BYTES // QUEUED_MESSAGE_BYTES // max(1, world_size)))


class Collector:
    def __init__(self, run_dir: Path, state: RunState, bind_host: str = "127.0.0.1",
                 port: int = 0, view_port: int = 0, secret: str | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.state = state
        fix_mmap_threshold()  # before the first big snapshot: RSS flat over a long run
        self.ctx: zmq.Context = zmq.Context.instance()
        self.auth: Any = None
        self.rejected_peers = 0  # handshakes refused: a peer without the run's keys
        self.eval_interval_s = eval_interval_s(state.world_size)
        # Key holders' connections to the ingest port, at most so many open (connections.py).
        self.connections = ConnectionCap(
            cap_for(state.world_size),
            lambda line: print(f"[traceml] collector: {line}", file=sys.stderr, flush=True))
        run_keys = None if secret is None else self._start_auth(secret)

        def bind(kind: int, host: str, fixed: int, hwm: int = 1000,
                 capped: bool = False) -> tuple[zmq.Socket, str]:
            sock = self.ctx.socket(kind)
            sock.setsockopt(zmq.LINGER, 0)
            descriptors.limit_handshake(sock)  # an idle connection's descriptor comes back
            sock.setsockopt(zmq.RCVHWM, hwm)
            # A peer announcing a bigger frame is dropped at the header, before libzmq
            # allocates it: no sender can make the collector hold more than this per frame.
            sock.setsockopt(zmq.MAXMSGSIZE, TRANSPORT_FRAME_LIMIT)
            if run_keys is not None:
                keys.secure_server(sock, run_keys)
                if capped:  # its handshakes go to the connection cap too
                    sock.zap_domain = INGEST_ZAP_DOMAIN.encode()
            if fixed:
                sock.bind(f"tcp://{host}:{fixed}")
            else:
                fixed = sock.bind_to_random_port(f"tcp://{host}")
            # A wildcard bind is reached locally through loopback.
            local = "127.0.0.1" if host in ("0.0.0.0", "*") else host
            return sock, f"tcp://{local}:{fixed}"

        self.ingest, self.ingest_addr = bind(zmq.ROUTER, bind_host, port,
                                             recv_hwm(state.world_size), capped=True)
        # Only the launcher on this host talks to control: loopback, whatever the bind.
        self.control, self.control_addr = bind(zmq.REP, "127.0.0.1", 0)
        # Viewers on other hosts need the view socket where agents reach the collector.
        self.view, self.view_addr = bind(zmq.REP, bind_host, view_port)
        self.view_remote: str | None = None  # how other hosts reach the view socket
        # Connections refused or timed out in the handshake (before the pump owns ingest),
        # and descriptors held back for our own files (descriptors.py).
        self.handshakes = descriptors.HandshakeCounter()
        self.handshakes.watch(self.ingest, CONNECTION_EVENTS, self.connections.seen)
        for sock in (self.control, self.view):
            self.handshakes.watch(sock)
        self.reserve = descriptors.Reserve()
        self.metrics: Any = None  # the /metrics server (metrics.MetricsServer), if any
        self.metrics_error: str | None = None  # why there is none, when it was asked for
        # The ingest socket belongs to its pump thread from here on (ingest_pump.py).
        self.pump = IngestPump(self.ctx, self.ingest)
        self.pump.start()
        self.poller = zmq.Poller()
        self.poller.register(self.pump.wake, zmq.POLLIN)
        self.poller.register(self.control, zmq.POLLIN)
        self.poller.register(self.view, zmq.POLLIN)
        # The handshake monitors too: their events are read when there are some, not by a
        # refused receive (an exception each) per monitor at every turn of the loop.
        for mon in self.handshakes.monitors:
            self.poller.register(mon, zmq.POLLIN)
        self.monitors = frozenset(self.handshakes.monitors)
        # A collector started on a folder that already holds a live record (a restart):
        # keep that record beside ours, and never call ours complete.
        self.earlier_record = self._keep_earlier_record()
        self.routes: dict[int, Route] = {}  # rank -> its connection, to send it requests
        # rank -> (pid, hang since): the stack asked of its node relay in this hang
        self.stacks_asked: dict[int, tuple[int, float | None]] = {}
        self.captures = DeepTraceBoard(self.run_dir)
        self.step_log = StepLogWriter(RunFolder(self.run_dir).step_log)
        self.pending = columns.Pending()  # relayed rows whose records wait for the flush
        self.views = ViewServer(self.view, state, self.captures, self.routes, self.pump.send)
        self.stopping = False
        self.done = False
        self.finishing: tuple[Finish, bool] | None = None  # (request, reply to launcher?)
        self.finish_deadline = 0.0
        self.finish_quiet_s = QUIET_S
        self.exit_when_done = False
        self.parent_pid: int | None = None  # the launcher, watched when given
        self.control_key: str | None = None  # --control-key-stdin: the launcher's key

    def _keep_earlier_record(self) -> str | None:
        live = RunFolder(self.run_dir).live
        if not live.exists():
            return None
        n = 1
        while (kept := RunFolder(self.run_dir).kept_live(n)).exists():
            n += 1
        try:
            live.rename(kept)
        except OSError:
            return str(live)
        return str(kept)

    def _start_auth(self, secret: str) -> keys.CurveKeys:
        """CURVE on every socket, and a ZAP authenticator that admits only the run's
        client key: a peer without the secret never gets a message in."""
        run_keys = keys.derive(secret)

        def rejected() -> None:
            self.rejected_peers += 1

        self.auth = start_authenticator(self.ctx, run_keys, rejected,
                                        (INGEST_ZAP_DOMAIN, self.connections.admit))
        return run_keys

    # --- lifecycle ------------------------------------------------------------------

    def announce(self) -> None:
        info = {"ingest": self.ingest_addr, "control": self.control_addr, "view": self.view_addr,
                "pid": os.getpid(), "run_name": self.state.run_name,
                "host": socket.gethostname(), "view_remote": self.view_remote,
                "metrics_error": self.metrics_error}
        folders.write_atomic(RunFolder(self.run_dir).collector_json,
                             json.dumps(info, indent=2) + "\n")

    def serve(self) -> None:
        next_eval = next_snap = time.monotonic()
        while not self.done:
            events = dict(self.poller.poll(0 if self.pump.pending() else 100))
            if self.pump.wake in events or self.pump.pending():
                self.drain()
            if self.control in events and self.finishing is None:  # REP: one at a time
                self.handle_control()
            if self.view in events:
                self.views.handle()
            if not self.monitors.isdisjoint(events):
                self.handshakes.drain()
            now = time.monotonic()
            if now >= next_eval:
                viewed = self.views.take_spent()  # views built for viewers since the last
                self._count_refusals()
                self.state.counters["rejected_peers"] = self.rejected_peers
                self.state.counters["backlog_refused"] = self.pump.refused
                self.state.waiting_routes = self.pump.waiting_routes()
                self.state.evaluate(time.time(), time.monotonic())
                self.ask_relays_for_stacks()
                self.views.refresh()
                self.step_log.flush_if_due()
                cost = time.monotonic() - now + viewed
                next_eval = now + max(self.eval_interval_s, EVAL_BACKOFF * cost)
            if now >= next_snap:
                self.write_live()
                done = time.monotonic()
                next_snap = done + max(SNAPSHOT_INTERVAL_S, SNAPSHOT_BACKOFF * (done - now))
            if self.parent_pid and os.getppid() != self.parent_pid and not self.stopping:
                # The launcher died without asking us to finish (SIGKILL, OOM): nobody
                # will; write what we have, marked incomplete, and leave.
                print("[traceml] collector: the launcher is gone; writing the record",
                      file=sys.stderr, flush=True)
                self.stopping = True
            if self.finishing is not None:
                if self.finish_ready():
                    request, reply_to_launcher = self.finishing
                    reply = self.write_record(request)
                    if reply_to_launcher:
                        self.control.send_json(reply)
            elif self.stopping:  # SIGTERM: write what we have and leave
                self.start_finish(Finish(complete=False))
            elif self.exit_when_done and self.all_ranks_finished():
                codes = [rs.exit_code for rs in self.state.ranks.values()]
                self.start_finish(Finish(torchrun_exit=0 if not any(codes) else 1, grace_s=0.0))

    def _count_refusals(self) -> None:
        """Connections turned away, shown beside the ingest counters."""
        counters = self.state.counters
        counters["refused_connections"] = self.handshakes.failed
        counters["connections_over_cap"] = self.connections.refused
        self.connections.tell()
        if self.metrics is not None:
            counters["metrics_refused"] = self.metrics.refused
            counters["metrics_timed_out"] = self.metrics.timed_out

    def all_ranks_finished(self) -> bool:
        ranks = self.state.ranks
        return len(ranks) == self.state.world_size and all(r.finished for r in ranks.values())

    def drain(self, limit: int = DRAIN_BATCH) -> int:
        n = 0
        mono = time.monotonic()
        deadline = mono + DRAIN_SLICE_S
        while n < limit and mono <= deadline:
            # A batch of at most DRAIN_TAKE_BYTES: a key holder's 1 MiB messages, 256 at a
            # time, held the drain (and every viewer) for seconds past its slice.
            batch = self.pump.take(min(256, limit - n), DRAIN_TAKE_BYTES)
            if not batch:
                break
            n += len(batch)
            for frames in batch:
                self._receive(frames, mono)
            self.flush_columns()
            mono = time.monotonic()
        return n

    def _receive(self, frames: list[bytes], mono: float) -> None:
        if len(frames) == 2:
            self._receive_one((frames[0], None), frames[1], mono)
        elif len(frames) == 3 and frames[1] == RELAY_TAG:
            self._receive_relayed(frames, mono)
        elif len(frames) == 3 and frames[1] == RELAY_STACKS_TAG:
            self._receive_stacks(frames[0], frames[2])
        else:
            self.state.intake.count_malformed()

    def _receive_relayed(self, frames: list[bytes], mono: float) -> None:
        """A node relay's batch: each payload as if its rank had sent it directly."""
        try:
            batch = decode_relay_batch(frames[2])
        except ProtocolError:
            self.state.intake.count_malformed()
            return
        conn = frames[0]
        cols = batch.cols
        if cols is None and batch.beats is None and batch.samples is None:
            for route, payload in zip(batch.routes, batch.payloads, strict=True):
                self._receive_one((conn, route), payload, mono)
        else:
            # An empty payload stands for the next column row (protocol.StepColumns), a
            # mark for the next heartbeat or sample (protocol.BEAT_MARK, SYS_MARK).
            rows = () if cols is None else cols.rows
            opened = [] if cols is None else columns.open_groups(cols.groups, cols.rows)
            beats, samples = iter(batch.beats or ()), iter(batch.samples or ())
            i = 0
            for route, payload in zip(batch.routes, batch.payloads, strict=True):
                if not payload:
                    self._receive_row((conn, route), rows[i], opened[i], mono)
                    i += 1
                elif payload == BEAT_MARK:
                    self._receive_typed((conn, route), next(beats), mono)
                elif payload == SYS_MARK:
                    self._receive_typed((conn, route), next(samples), mono)
                else:
                    self._receive_one((conn, route), payload, mono)
        # Its counters after its payloads: they count only from the connection that relays
        # the node's ranks (a hello in this very batch included), not from any key holder.
        self.state.intake.relay_seen(batch.node, batch.batches, batch.dropped, mono, conn)

    def _receive_typed(self, route: Route, wire: Heartbeat | Sys, mono: float) -> None:
        """A relayed heartbeat or sys sample, decoded and checked by its Struct with its
        batch (decode()'s other checks here): straight into its rank's record where the
        rank is known on this connection (Intake.relayed), else taken as the message it
        is. Neither meets rows waiting for the flush but as _take says."""
        if not relayed_ok(wire):
            self.state.intake.count_malformed()
            return
        rank = wire.id.rank
        beat = isinstance(wire, Heartbeat)
        if self.state.intake.relayed(wire, mono, route):
            if beat and rank in self.pending.ranks:
                self.pending.beat(rank)
            self.routes[rank] = route
            return
        self._take(route, Message("heartbeat" if beat else "sys", wire.id, wire.seq, wire.t,
                                  wire), mono)

    def _receive_row(self, route: Route, row: StepRow,
                     opened: tuple[columns.Group, int] | None, mono: float) -> None:
        """One column row: taken at once for its envelope, its records with the drain's
        others (flush_columns), or else ingested as the steps message it stands for."""
        if opened is None or columns.row_error(row, opened[0]) is not None:
            self.state.intake.count_malformed()
            return
        group, start = opened
        if columns.take_row(self.state, self.pending, row.id, route, mono, row, group, start):
            self.routes[row.id.rank] = route
            if self.pending.records >= columns.MAX_PENDING_RECORDS:  # a flush's memory
                self.flush_columns()
            return
        self._take(route, columns.message_of(row, group, start), mono)

    def flush_columns(self) -> None:
        """The records of the rows taken since the last flush, into the state and the
        step log (judge/ingest_columns.py)."""
        if not self.pending.ranks:
            return
        for run in columns.flush(self.state, self.pending):
            self.step_log.append_columns(run.phases, run.rank, run.step, run.t_end,
                                         run.step_ms, run.values)

    def ask_relays_for_stacks(self) -> None:
        """While a hang names ranks behind a node relay that sent no stack of their own
        (stuck in native code holding the GIL, they cannot), ask that relay, once per
        rank and hang: its launcher dumps them (native_stacks.NodeStackServer)."""
        report = self.state.hang
        if report is None:
            self.stacks_asked.clear()
            return
        for rank in report.culprits[:MAX_STACK_ASKS]:
            rs = self.state.ranks.get(rank)
            if rs is None or rs.stacks or not (isinstance(rs.conn, tuple)
                                               and rs.conn[1] is not None):
                continue  # unknown, has a stack, or not relayed (node 0's own watcher)
            asked = (rs.ident.pid, self.state.hang_since)
            if self.stacks_asked.get(rank) == asked:
                continue
            self.stacks_asked[rank] = asked
            self.pump.send((rs.conn[0], RELAY_SELF_ROUTE), encode_relay_stacks(
                RelayStackRequest(rank, rs.ident.pid)))

    def _receive_stacks(self, conn: bytes, data: bytes) -> None:
        """A node's dump of one of its ranks: taken only when asked, for that pid, and
        from the very connection that relays that rank's messages (Intake.relay_stack)."""
        try:
            dump = decode_relay_stacks(data)
        except ProtocolError:
            self.state.intake.count_malformed()
            return
        asked = self.stacks_asked.get(dump.rank) if isinstance(dump, RelayStacks) else None
        if (not isinstance(dump, RelayStacks) or asked is None or asked[0] != dump.pid
                or not self.state.intake.relay_stack(conn, dump.node, dump.rank, dump.pid,
                                              dump.text)):
            self.state.counters["stacks_refused"] = (
                self.state.counters.get("stacks_refused", 0) + 1)

    def _receive_one(self, route: Route, payload: bytes, mono: float) -> None:
        try:
            if steps_columns.maybe_steps(payload):  # a large one is checked as columns
                wire = decode_wire(payload)
                if isinstance(wire, Steps):
                    self._receive_large(route, wire, mono)
                    return
                msg = message(wire)
            else:
                msg = decode(payload)
        except ProtocolError:
            self.state.intake.count_malformed()
            return
        self._take(route, msg, mono)

    def _receive_large(self, route: Route, wire: Steps, mono: float) -> None:
        """A large steps message (collect/steps_columns.py): as a relay's column row when
        it is the next batch of a rank known on this connection; else its envelope first,
        and its records made into objects only if the state takes it."""
        try:
            row, src = steps_columns.columns_of(wire)
        except ProtocolError:
            self.state.intake.count_malformed()
            return
        opened = columns.open_groups([src], [row])[0]
        if opened is None or columns.row_error(row, opened[0]) is not None:
            self.state.intake.count_malformed()
            return
        group, start = opened
        rank = row.id.rank
        if columns.take_row(self.state, self.pending, row.id, route, mono, row, group, start):
            self.routes[rank] = route
            if wire.colls:
                self.state.collectives.add(rank, wire.colls)
            if self.pending.records >= columns.MAX_PENDING_RECORDS:
                self.flush_columns()
            return
        forced = (0,) * len(group.phases) if row.forced is None else tuple(row.forced)
        envelope = Message("steps", row.id, row.seq, row.t, replace(wire, records=[]),
                           group.phases, (), forced, columns.refused_in(row, group, start))
        if not self._take(route, envelope, mono):
            return  # another connection's rank, or not of this run: its records never made
        records = columns.message_of(row, group, start).records
        rs = self.state.ranks[rank]
        self.state.intake.take_records(rs, records, group.phases)
        self.state.intake.stepped_past_stacks(rs)
        self.step_log.append_records(rank, group.phases, records)

    def _take(self, route: Route, msg: Message, mono: float) -> bool:
        pending = self.pending
        waits = bool(pending.ranks) and msg.ident.rank in pending.ranks
        # Its rows waiting go first; a sys sample does not meet them, and a heartbeat only
        # where flush settles by their order (ingest_columns.py).
        if waits and msg.kind not in ("heartbeat", "sys"):
            self.flush_columns()
        if not self.state.ingest(msg, mono, route):  # a live rank's record is its connection's
            return False
        if waits and msg.kind == "heartbeat":
            pending.beat(msg.ident.rank)
        rank = msg.ident.rank
        self.routes[rank] = route
        if msg.kind == "steps":
            self.step_log.append_records(rank, msg.phases, msg.records)
        elif isinstance(msg.body, Capture):
            self.captures.on_event(rank, msg.body)
        return True

    def write_live(self) -> None:
        try:
            with summary.gc_paused():
                snap = self.state.snapshot(time.time(), time.monotonic(), full=True,
                                           window_max_age_s=WINDOW_REFRESH_S)
                text = summary.to_json(summary.build(snap, summary.RunMeta(complete=False)))
                del snap  # freed here, while no collection can run
            descriptors.write_anyway(  # whatever the sockets hold, the record is written
                lambda: folders.write_atomic(RunFolder(self.run_dir).live, text),
                self.reserve)
        except OSError as exc:  # a full disk costs the snapshot, not the collector
            print(f"[traceml] collector: could not write snapshot: {exc}", file=sys.stderr)

    # --- control --------------------------------------------------------------------

    def handle_control(self) -> None:
        """One control request, decoded and validated by its Struct (requests.py): a bad
        one is answered with why, and never costs the record."""
        try:
            request = decode_control(self.control.recv())
        except RequestError as exc:
            self._control_reply(ControlReply(False, str(exc)))
            return
        if isinstance(request, LAUNCHER_OPS) and not self._from_launcher(request.key):
            # The run's secret is in every rank: it admits a peer to this socket, but
            # only the launcher's own key ends the record or adds a stack to it.
            counters = self.state.counters
            counters["control_refused"] = counters.get("control_refused", 0) + 1
            op = type(request).__struct_config__.tag
            self._control_reply(ControlReply(False, f"{op} refused: not the launcher"))
            return
        if isinstance(request, Ping):
            self._control_reply(ControlReply(True, ranks=len(self.state.ranks)))
        elif isinstance(request, NativeStack):  # from node 0's launcher (native_stacks.py)
            if request.rank >= self.state.world_size:
                self._control_reply(ControlReply(False, "rank out of range"))
                return
            self.state.intake.set_native_stack(request.rank, request.pid, request.text)
            self._control_reply(ControlReply(True))
        else:  # the record is only ever finished by a well-formed request
            self.start_finish(request, reply_to_launcher=True)  # answered when written

    def _control_reply(self, reply: ControlReply) -> None:
        self.control.send(encode_reply(reply))

    def _from_launcher(self, key: object) -> bool:
        """A request carrying the key `traceml run` gave us on stdin (none by hand: a
        hand-started collector has no launcher, and its secret is the only lock)."""
        if self.control_key is None:
            return True
        return isinstance(key, str) and hmac.compare_digest(key.encode(),
                                                            self.control_key.encode())

    def start_finish(self, request: Finish, reply_to_launcher: bool = False) -> None:
        """Begin the end of the run: wait (a bounded time) for the ranks' goodbyes while
        still serving viewers, then `write_record`. Never blocks the serve loop."""
        multinode = self.state.nnodes > 1
        grace = FINISH_GRACE_MULTINODE_S if multinode else FINISH_GRACE_S
        self.finish_quiet_s = QUIET_MULTINODE_S if multinode else QUIET_S
        self.finish_deadline = time.monotonic() + (
            grace if request.grace_s is None else request.grace_s)
        self.finishing = (request, reply_to_launcher)

    def finish_ready(self) -> bool:
        """Every rank said goodbye, or the grace ran out, or (torchrun has exited) the
        ranks that did not say goodbye have been quiet long enough to be gone."""
        assert self.finishing is not None
        now = time.monotonic()
        if now >= self.finish_deadline or self.all_ranks_finished():
            return True
        if self.finishing[0].torchrun_exit is None and not self.stopping:
            return False  # torchrun is running: its ranks' goodbyes are still to come
        # torchrun exited, or we were told to stop (SIGTERM, the launcher gone): the ranks
        # that are still talking get the grace, silent ones (or none at all) are not waited
        # for (a SIGTERM with no rank connected took the whole 10 s multi-node grace).
        quiet_since = now - self.finish_quiet_s
        return all(r.finished or r.last_seen < quiet_since for r in self.state.ranks.values())

    def nodes_never_seen(self) -> list[int]:
        """Nodes of a multi-node run from which no rank ever reported: the record holds
        nothing of them, so it is not complete (their relay could not start, or their
        agents never reached us)."""
        if self.state.nnodes <= 1:
            return []
        seen = {rs.ident.node for rs in self.state.ranks.values()}
        # Elastic membership (--nnodes MIN:MAX): only the first MIN nodes must report.
        needed = self.state.min_world_size // max(1, self.state.nproc_per_node)
        return [n for n in range(max(1, needed)) if n not in seen]

    def write_record(self, request: Finish) -> dict[str, Any]:
        """Write the final summary; the reply the launcher prints."""
        self.drain()
        self.handshakes.drain()
        self._count_refusals()
        self.state.evaluate(time.time(), time.monotonic())
        if request.interrupted or request.exit_code is not None:
            # Stopped by a signal: a hang the stop itself ended stays the record's verdict.
            self.state.keep_latched_hang()
        failures = self.state.failures()
        root = request.root_cause
        if root is not None and root[0] in self.state.ranks:
            # torchrun saw this rank fail first; a rank killed by a signal said no goodbye,
            # and one whose goodbye said 0 died after it, at exit (torchrun's word on
            # whether it failed wins: fresh-clone run 43's SIGABRT in gloo's teardown left
            # a record with no failure). A rank whose goodbye named a failure is already in
            # `failures`, in the order the failures happened: keep that order (torchrun on
            # one node knows only that node's ranks).
            rank, exitcode = root
            rs = self.state.ranks[rank]
            end = exit_codes.root_cause_end(exitcode, rs.exit_code, rs.error)
            if end is not None:
                rs.exit_code, rs.error = end
                failures = exit_codes.lead_with(failures, rank, exitcode)
        code, failed = exit_codes.job_exit_code(
            request.torchrun_exit, request.interrupted, failures)
        if request.exit_code is not None:
            code = request.exit_code
        extra = dict(request.extra)
        if self.earlier_record:
            extra["collector_restarted"] = {"earlier_record": self.earlier_record}
        unseen = self.nodes_never_seen()
        if unseen:  # e.g. that node's relay could not start: none of its ranks is here
            extra["nodes_never_seen"] = unseen
        meta = summary.RunMeta(
            command=list(request.command), exit_code=code,
            ended_at=request.ended_at or time.time(),
            complete=(request.complete and not self.earlier_record
                      and not unseen),
            failed_rank=failed, extra=extra)
        with summary.gc_paused():
            doc = summary.build(  # one model: the file, its text, the reply
                self.state.snapshot(time.time(), time.monotonic(), full=True, record=True),
                meta)
        note = "" if not unseen else (
            f"INCOMPLETE: no rank of node(s) {', '.join(map(str, unseen))} ever reported (its "
            f"relay or agents never reached node 0; its own terminal says why).\n")
        reply = ending.summary_reply(  # a full disk: the record still reaches the terminal
            self.run_dir, doc, lambda: descriptors.write_anyway(
                lambda: summary.write_summary(self.run_dir, doc), self.reserve), note)
        self.step_log.close()
        self.done = True
        return reply.to_wire()

    def close(self) -> None:
        self.pump.stop()  # closes the ingest socket on its own thread
        self.control.close()
        self.view.close()
        self.handshakes.close()
        if self.metrics is not None:
            self.metrics.stop()
        if self.auth is not None:
            self.auth.stop()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="traceml collector",
                                description="Collect from agents and write the run's summary.")
    p.add_argument("--run-dir", required=True, type=Path)
    p.add_argument("--run-name", default="")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--nproc-per-node", type=int, default=None)
    p.add_argument("--bind", default="127.0.0.1",
                   help="address for the ingest and view sockets (default loopback only)")
    p.add_argument("--port", type=int, default=0, help="ingest port (0: any free port)")
    p.add_argument("--view-port", type=int, default=0, help="view port (0: any free port)")
    p.add_argument("--secret-file", type=Path, default=None,
                   help="the run's secret (default: $TRACEML_SECRET, else RUN_DIR/secret.key); "
                        "with one, every socket requires the run's CURVE keys")
    p.add_argument("--advertise", default=None, metavar="HOST",
                   help="the address other hosts use for this one (written to collector.json, "
                        "so `traceml watch RUN_DIR` works from another node)")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --bind without a secret (anyone who can reach "
                        "the port can then send data)")
    p.add_argument("--started-at", type=float, default=None)
    p.add_argument("--min-world-size", type=int, default=None, metavar="N",
                   help="torchrun's --nnodes MIN:MAX: ranks of a world this small or larger "
                        "belong to the run")
    p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="torchrun restarts the group up to N times: no HANG while it does")
    p.add_argument("--hang-after", type=float, default=None, metavar="SECONDS",
                   help="declare a hang after this long without a step (default: derived "
                        "from step times, at least 10 s)")
    p.add_argument("--preflight", type=Path, default=None, metavar="NETCHECK_JSON",
                   help="the preflight's netcheck.json (traceml run --preflight)")
    p.add_argument("--parent-pid", type=int, default=None, metavar="PID",
                   help="the launcher's pid: if it dies, write the record and exit")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics at /metrics on this port (docs/metrics.md)")
    p.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                   help="address the metrics bind (default 127.0.0.1)")
    p.add_argument("--control-key-stdin", action="store_true",
                   help="read a key from stdin (one line, 64 hex characters): finish and "
                        "native_stack control requests must carry it (traceml run does this)")
    p.add_argument("--exit-when-done", action="store_true",
                   help="write the summary and exit once every rank has said goodbye")
    return p


def _read_preflight(path: Path) -> dict[str, Any]:
    """What the summary keeps of the preflight (our own file, written before training)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return {"path": str(path), "error": f"unreadable: {exc}"}
    largest = (doc.get("collectives") or {}).get("all_reduce") or [{}]
    return {"path": str(path), "healthy": bool(doc.get("healthy")),
            "slow": list(doc.get("slow") or []), "mtu_mismatch": doc.get("mtu_mismatch"),
            "missing": doc.get("missing"), "wall_s": doc.get("wall_s"),
            "all_reduce_busbw_gbps": largest[-1].get("busbw_gbps"),
            "all_reduce_bytes": largest[-1].get("bytes")}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.world_size < 1:
        print("traceml collector: --world-size must be at least 1", file=sys.stderr)
        return 2
    args.run_dir.mkdir(parents=True, exist_ok=True)
    try:  # from here on the record is written through this folder's descriptor
        folders.pin_dir(args.run_dir)
    except PermissionError as exc:
        print(f"traceml collector: run folder {exc}: not using it", file=sys.stderr)
        return 2
    descriptors.raise_limit()  # every connection costs a descriptor (descriptors.py)
    try:
        secret = keys.load_secret(args.run_dir, args.secret_file)
    except (OSError, keys.SecretError) as exc:
        print(f"traceml collector: cannot use the secret: {exc}", file=sys.stderr)
        return 2
    if secret is None and args.bind not in LOOPBACK and not args.insecure:
        print(f"traceml collector: --bind {args.bind} would take data from the network without "
              f"authentication; give the run a secret (docs/security.md) or pass --insecure",
              file=sys.stderr)
        return 2
    if secret is not None and not zmq.has("curve"):
        print("traceml collector: this pyzmq has no CURVE support", file=sys.stderr)
        return 2
    state = RunState(args.run_name or args.run_dir.name, args.world_size, args.nnodes,
                     args.nproc_per_node, args.started_at or time.time(),
                     hang_after_s=args.hang_after, max_restarts=max(0, args.max_restarts),
                     min_world_size=args.min_world_size)
    if args.parent_pid:  # started by the launcher: the job's processes are below it
        state.of_the_job = JobLineage(args.parent_pid)
    if args.preflight is not None:
        state.set_preflight(_read_preflight(args.preflight))
    try:
        collector = Collector(args.run_dir, state, args.bind, args.port, args.view_port, secret)
        if args.advertise:
            view_port = collector.view_addr.rsplit(":", 1)[1]
            collector.view_remote = f"tcp://{args.advertise}:{view_port}"
    except zmq.ZMQError as exc:
        print(f"traceml collector: cannot listen on {args.bind} ports {args.port}/"
              f"{args.view_port}: {exc}", file=sys.stderr)
        return 2
    collector.exit_when_done = args.exit_when_done
    if args.control_key_stdin:
        key = sys.stdin.readline().strip()
        if len(key) != CONTROL_KEY_CHARS or not all(c in "0123456789abcdef" for c in key):
            print("traceml collector: --control-key-stdin: expected 64 hex characters on stdin",
                  file=sys.stderr)
            collector.close()
            return 2
        collector.control_key = key
    collector.parent_pid = args.parent_pid
    if args.metrics_port is not None:
        try:
            from . import metrics

            views = collector.views
            views.eager = True  # the metrics thread reads the tick's view as it is
            collector.metrics = metrics.serve(lambda: (views.now, views.snap), state.run_name,
                                              args.metrics_host, args.metrics_port)
        except (ImportError, OSError) as exc:  # the run goes on without the metrics
            # Said in collector.json too: the launcher prints it on the user's terminal.
            collector.metrics_error = (f"no Prometheus metrics on {args.metrics_host}:"
                                       f"{args.metrics_port}: {exc}")
            print(f"[traceml] collector: {collector.metrics_error}", file=sys.stderr, flush=True)
        else:
            print(f"[traceml] collector: Prometheus metrics at http://{args.metrics_host}:"
                  f"{args.metrics_port}/metrics", file=sys.stderr, flush=True)

    def on_term(signum: int, frame: Any) -> None:
        collector.stopping = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    collector.announce()
    print(f"[traceml] collector for {state.run_name!r} ({args.world_size} ranks) "
          f"listening on {collector.ingest_addr}\n"
          f"[traceml] start the ranks with TRACEML_ENDPOINT={collector.ingest_addr}",
          file=sys.stderr, flush=True)
    try:
        collector.serve()
    finally:
        collector.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
