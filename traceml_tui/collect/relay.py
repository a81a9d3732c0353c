"""A relay per node: the node's ranks send here, and one batch per tick goes to node 0.

Without it, node 0's collector holds one encrypted connection per rank and takes one
ZeroMQ message per rank every ~100 ms: at 16,384 ranks that is 16,384 CURVE sessions
and ~160,000 messages a second through one process. With it, the `traceml run` of every
other node starts this relay (`python -m traceml_tui.collect.relay`), the node's ranks connect
to it over loopback, and node 0 receives one message per node per tick, carrying that
node's rank messages (protocol.RELAY_TAG): unchanged, except plain steps messages, which
the relay decodes and sends as packed columns (relay_columns.py), so node 0 ingests a
drain's steps with array operations instead of decoding each message, and heartbeats and
sys samples, which the relay checks and sends in typed lists, decoded with the batch. The collector
still validates every rank message and every column row itself, as strictly: a relay
holds the same key as a rank, not more.

The relay never slows the training: the ranks' sends are as non-blocking as before,
its own queues are bounded (what does not fit is dropped and counted, and the count
reaches the collector in the next batch), and if the relay dies the ranks' messages
queue in their own bounded sockets and are dropped there: the collector sees the
node's ranks fall silent, as it would for a lost network, and says so.

Requests from the collector to a rank (a deep-trace capture) come back the same way,
addressed by the route number the batch gave the rank's message. One route is the
relay's own (protocol.RELAY_SELF_ROUTE): the collector asks there for the stacks of this
node's stuck ranks, which the relay passes to its launcher (the ranks' ancestor, which
alone may ptrace them) over a private socketpair and sends the dumps up the same
connection as its batches (protocol.RELAY_STACKS_TAG; docs/hangs.md).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from traceml_agent import env, handover, keys
from traceml_agent.protocol import (
    MAX_MESSAGE_BYTES,
    MAX_RELAY_BATCH,
    MAX_RELAY_STACKS_BYTES,
    RELAY_MARKS,
    RELAY_ROUTE,
    RELAY_SELF_ROUTE,
    RELAY_STACKS_TAG,
    RELAY_TAG,
    ProtocolError,
    RelayStackRequest,
    RelayStacks,
    decode_relay_stacks,
    encode_relay_batch,
    encode_relay_stacks,
)
from traceml_agent.sanitize import clean_line
from traceml_agent.transport import send_interval_s
from traceml_tui.runfolder import folders

from . import descriptors
from . import relay_columns as columns
from .auth import start_authenticator
from .relay_watch import RANKS_WAIT_S, RelayWatch

TICK_S = 0.2  # one batch per tick: ~5 messages a second per node reach node 0 (at least)
MAX_TICK_S = 0.5
# A relay batch costs node 0 ~50 us of its core whatever it holds (its frame through
# CURVE and the ingest pump, its decode and bookkeeping): the job's relays together send
# at most about this many a second, their ticks spaced out past ~50 nodes (0.5 s from
# 128 nodes: benchmarks/soak.py at 1,024 ranks on 128 nodes took 10.6 % of a core at
# 0.2 s ticks, 8.5 % at 0.5 s).
RELAY_BATCHES_PER_S = 256
KEEPALIVE_S = 1.0  # an empty batch at least this often: the collector sees the relay live
# Payload bytes per relay message: any valid rank message fits alone (a batch may carry
# protocol.MAX_RELAY_BATCH_BYTES), and small ones share a batch up to this much.
BATCH_BYTES = MAX_MESSAGE_BYTES
PENDING_BYTES = 32 << 20  # held between ticks; past it rank messages are dropped, counted
UPSTREAM_HWM = 64  # relay messages queued for node 0 (~13 s of ticks), then dropped
# Per rank connection, messages queued in libzmq before we take them: the collector's own
# bound (collector.MAX_RECV_HWM, measured there; tests/collect/test_relay.py keeps them equal).
LOCAL_HWM = 16
MAX_ROUTES = 4_096  # local connections remembered (a node runs a few dozen ranks at most)
MAX_PER_NODE = 1_024  # a local rank past this is no node's: it stretches no tick further
LINGER_MS = 1_000  # at exit, how long the last batch may take to leave


def tick_s(world_size: int, per_node: int = 1) -> float:
    """Seconds between batches, within [TICK_S, MAX_TICK_S]: half the interval at which the
    job's ranks send their steps (agent/transport.send_interval_s), and long enough that
    the job's relays together send node 0 at most RELAY_BATCHES_PER_S batches (its nodes:
    the world over `per_node`, the ranks a relay sees on its own node). Node 0 pays for
    each batch whatever it holds: at 16,384 ranks, 0.2 s ticks were 10,000 batches a
    second of ~7 messages. A rank's messages wait at most a tick longer than they did."""
    nodes = -(-world_size // max(1, per_node))
    return min(MAX_TICK_S, max(TICK_S, send_interval_s(world_size) / 2,
                               nodes / RELAY_BATCHES_PER_S))


class Relay:
    """One node's relay: a loopback ROUTER for its ranks, a DEALER to the collector.

    Several can share a process and a context (benchmarks/soak.py runs thousands, fed
    through `add()` and sent by `tick()`); the relay process drives one with `serve()`.
    """

    def __init__(self, ctx: zmq.Context, upstream: str, node: int,
                 run_keys: keys.CurveKeys | None, local_port: int = 0,
                 local_fd: int | None = None, stacks: socket.socket | None = None,
                 say: Callable[[str], None] | None = None,
                 ranks_wait_s: float = RANKS_WAIT_S, local_ipc: str | None = None) -> None:
        """`local_fd`: a loopback socket already bound and listening on `local_port`
        (the launcher's, inherited): used as it is, so the port is never free between
        its reservation and its use. `local_ipc`: a Unix socket's path instead of the
        port (`local_fd` then that socket's, bound and listening). `stacks`: the
        launcher's end of a SOCK_SEQPACKET pair, where stack requests go and dumps come
        from (none: no stacks here).
        `say`: where the relay's news goes (relay_watch.py: its node's terminal); none,
        no monitors (benchmarks/soak.py runs thousands of relays)."""
        self.node = node
        self.stacks = stacks
        if stacks is not None:
            stacks.setblocking(False)
        self.local = ctx.socket(zmq.ROUTER)
        self.local.setsockopt(zmq.LINGER, 0)
        self.local.setsockopt(zmq.RCVHWM, LOCAL_HWM)
        self.local.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES + 1024)
        self.up = ctx.socket(zmq.DEALER)
        self.up.setsockopt(zmq.SNDHWM, UPSTREAM_HWM)
        self.up.setsockopt(zmq.LINGER, LINGER_MS)
        self.up.setsockopt(zmq.MAXMSGSIZE, 1024)  # node 0 sends it only small requests
        # An idle or stalled connection gives its descriptor back after 5 s, not libzmq's
        # 30 s: ~1,000 of them once blinded a relay (issue 42, item 4; descriptors.py).
        descriptors.limit_handshake(self.local)
        descriptors.limit_handshake(self.up)
        if run_keys is not None:
            keys.secure_server(self.local, run_keys)
            keys.secure_client(self.up, run_keys)
        if local_fd is not None:
            self.local.setsockopt(zmq.USE_FD, local_fd)
        if local_ipc:
            self.address = f"ipc://{local_ipc}"
            self.local.bind(self.address)
        else:
            if local_port:
                self.local.bind(f"tcp://127.0.0.1:{local_port}")
            else:
                local_port = self.local.bind_to_random_port("tcp://127.0.0.1")
            self.address = f"tcp://127.0.0.1:{local_port}"
        self.watch = (None if say is None else  # before the connect: its first handshake
                      RelayWatch(self.local, self.up, self.address, upstream, say,
                                 time.monotonic(), ranks_wait_s))
        self.up.connect(upstream)
        self._route_of: dict[bytes, int] = {}
        self._conn_of: dict[int, bytes] = {}
        self._next_route = 0
        self.stacks_sent = 0  # dumps of this node's ranks sent up
        self._routes: list[int] = []
        self._payloads: list[columns.Item] = []
        self._pending_bytes = 0
        self.batches = 0  # relay messages sent
        self.forwarded = 0  # rank messages sent on
        self.dropped = 0  # rank messages lost here (full queues)
        self._last_sent = 0.0
        self.world_size = 0  # as the ranks' steps messages say (0: none seen yet)
        self.per_node = 1  # ranks on this node, as far as their local ranks say
        self.tick_s = TICK_S

    # --- rank side ------------------------------------------------------------------

    def _route(self, conn: bytes) -> int:
        route = self._route_of.get(conn)
        if route is None:
            if len(self._route_of) >= MAX_ROUTES:  # bounded: forget the oldest half
                for old in list(self._route_of)[: MAX_ROUTES // 2]:
                    del self._conn_of[self._route_of.pop(old)]
            route = self._next_route
            self._next_route = (route + 1) & 0xFFFF_FFFF
            if self._next_route == RELAY_SELF_ROUTE:  # the relay's own, never a rank's
                self._next_route = 0
            self._route_of[conn] = route
            self._conn_of[route] = conn
        return route

    def add(self, conn: bytes, payload: bytes) -> None:
        """One rank message for the next batch: a plain steps message as a column row, a
        heartbeat or sys sample in its kind's list (relay_columns.py), anything else as it
        came. An empty one or a mark is no message at all (on the wire they stand for a
        column row, a heartbeat, a sample): it is not forwarded."""
        size = len(payload)
        if not size or payload in RELAY_MARKS:
            return
        if self._pending_bytes + size > PENDING_BYTES or size > MAX_MESSAGE_BYTES:
            self.dropped += 1
            return
        self._routes.append(self._route(conn))
        item = columns.item_of(payload)
        self._payloads.append(item)
        if isinstance(item, tuple) and not isinstance(item[0], bytes):
            ident = item[0][0].id
            if ident.world_size != self.world_size or ident.local_rank >= self.per_node:
                self.world_size = ident.world_size
                self.per_node = max(self.per_node, min(ident.local_rank + 1, MAX_PER_NODE))
                self.tick_s = tick_s(self.world_size, self.per_node)
        self._pending_bytes += size

    def on_local(self) -> None:
        """Take what the ranks sent."""
        recv = self.local.recv_multipart
        for _ in range(10_000):
            try:
                frames = recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) == 2:
                self.add(frames[0], frames[1])

    # --- collector side ---------------------------------------------------------------

    def on_upstream(self) -> None:
        """Requests from the collector to one of our ranks: [RELAY_TAG, route, request]."""
        while True:
            try:
                frames = self.up.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[0] != RELAY_TAG or len(frames[1]) != RELAY_ROUTE.size:
                continue
            route = RELAY_ROUTE.unpack(frames[1])[0]
            if route == RELAY_SELF_ROUTE:
                self._ask_launcher(frames[2])
                continue
            conn = self._conn_of.get(route)
            if conn is None:
                continue
            try:
                self.local.send_multipart([conn, frames[2]], zmq.NOBLOCK)
            except zmq.ZMQError:  # the rank is gone or its queue is full: a lost request
                pass

    def _ask_launcher(self, data: bytes) -> None:
        """A stack request from the collector, checked, to the launcher (best effort)."""
        try:
            request = decode_relay_stacks(data)
        except ProtocolError:
            return
        if self.stacks is None or not isinstance(request, RelayStackRequest):
            return
        try:
            self.stacks.send(encode_relay_stacks(request))
        except OSError:  # the launcher is gone or busy: no stack this time
            pass

    def on_stacks(self) -> None:
        """Dumps from the launcher: this node's ranks only, sent up beside the batches."""
        assert self.stacks is not None
        while True:
            try:
                data = self.stacks.recv(MAX_RELAY_STACKS_BYTES + 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            if not data:
                return
            try:
                dump = decode_relay_stacks(data)
            except ProtocolError:
                continue
            if not isinstance(dump, RelayStacks) or dump.node != self.node:
                continue
            try:
                self.up.send_multipart([RELAY_STACKS_TAG, encode_relay_stacks(dump)],
                                       zmq.NOBLOCK)
                self.stacks_sent += 1
            except zmq.ZMQError:
                pass

    def tick(self, now: float) -> None:
        """Send what is pending, in batches; an empty one now and then as a keepalive."""
        if not self._payloads and now - self._last_sent < KEEPALIVE_S:
            return
        routes, payloads = self._routes, self._payloads
        self._routes, self._payloads, self._pending_bytes = [], [], 0
        start = 0
        while True:
            end, size = start, 0
            while end < len(payloads) and end - start < MAX_RELAY_BATCH:
                size += columns.item_bytes(payloads[end])
                if size > BATCH_BYTES and end > start:
                    break
                end += 1
            batch = columns.relay_batch(self.node, self.batches, self.dropped,
                                        routes[start:end], payloads[start:end])
            try:
                self.up.send_multipart([RELAY_TAG, encode_relay_batch(batch)], zmq.NOBLOCK)
                self.batches += 1
                self.forwarded += end - start
            except zmq.ZMQError:  # node 0 is slow or gone: this batch is lost, counted
                self.dropped += end - start
            start = end
            if start >= len(payloads):
                break
        self._last_sent = now

    def serve(self, stop: Callable[[], bool]) -> None:
        poller = zmq.Poller()
        poller.register(self.local, zmq.POLLIN)
        poller.register(self.up, zmq.POLLIN)
        if self.stacks is not None:
            poller.register(self.stacks.fileno(), zmq.POLLIN)
        next_tick = time.monotonic() + self.tick_s
        while not stop():
            wait_ms = max(0, int((next_tick - time.monotonic()) * 1000))
            events = dict(poller.poll(min(wait_ms, 100)))
            if self.local in events:
                self.on_local()
            if self.up in events:
                self.on_upstream()
            if self.stacks is not None and self.stacks.fileno() in events:
                self.on_stacks()
            now = time.monotonic()
            if now >= next_tick:
                self.tick(now)
                next_tick = now + self.tick_s
                if self.watch is not None:
                    self.watch.check(now, bool(self._route_of))
        self.on_local()  # the ranks' last words (goodbyes) go out with the last batch
        self.tick(float("inf"))

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()
        self.local.close()
        self.up.close()  # lingers up to LINGER_MS for the last batch
        if self.stacks is not None:
            self.stacks.close()


def _secret(store: str | None, stopping: Callable[[], bool],
            secret_file: str | None = None) -> str | None:
    """The run's secret: from the environment, else from a shared run folder's file or
    torchrun's store, whichever has it first (handover.py)."""
    secret = keys.secret_from_env()
    if secret or not (store or secret_file):
        return secret
    return handover.fetch_secret(store, stopping,
                                 None if secret_file is None else Path(secret_file))


def reserve_loopback() -> socket.socket:
    """A loopback TCP socket bound to a free port and listening: the port is ours from
    here on (nobody can squat it), and ranks that connect early wait in its backlog."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


# A Unix socket's path must fit in sockaddr_un (108 bytes with its NUL on Linux).
MAX_UNIX_PATH = 100


def reserve_unix(path: Path) -> socket.socket | None:
    """A Unix socket bound at `path` (in the run folder, 0700: nobody but its owner can
    reach it) and listening; None where that cannot be (a path too long, a filesystem
    without sockets): the relay then listens on a loopback port instead."""
    if len(os.fsencode(path)) > MAX_UNIX_PATH:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if path.is_socket():  # an earlier attempt's, in our own folder
            path.unlink()
        sock.bind(str(path))
        os.chmod(path, 0o600)
        sock.listen(128)
    except OSError:
        sock.close()
        return None
    return sock


class RelayProcess:
    """The launcher's handle on its node's relay (`traceml run` on a node other than 0)."""

    def __init__(self, upstream: str, node: int, secret: str | None,
                 secret_store: str | None, log_path: Any, secret_file: Any = None,
                 say: Callable[[str], None] | None = None,
                 ranks_wait_s: float = RANKS_WAIT_S, unix_path: Path | None = None) -> None:
        """The port is reserved here, bound and listening, and the relay inherits that
        socket (ZeroMQ's USE_FD): the ranks are told the port at once, before the relay
        has the run's secret, and nobody else can take it meanwhile. `unix_path`: listen
        there instead (a Unix socket in the 0700 run folder: no other local user reaches
        it at all), where it can be (reserve_unix). `say` gets each line the relay has for
        its node's terminal (relay_watch.py), cleaned; all are also kept in `said`."""
        unix = None if unix_path is None else reserve_unix(unix_path)
        self.unix_path = None if unix is None else unix_path
        reserved = unix or reserve_loopback()
        news, news_w = os.pipe()  # the relay's lines for this node's terminal
        self.said: list[str] = []
        self._say = say
        # Stack requests to us and dumps back (ours: stacks_sock; the relay's: inherited).
        self.stacks_sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.port: int | None = None if unix else reserved.getsockname()[1]
        self.address = (f"ipc://{unix_path}" if unix else f"tcp://127.0.0.1:{self.port}")
        self.log_path = log_path
        self.stopping = False
        cmd = [sys.executable, "-m", "traceml_tui.collect.relay", "--upstream", upstream,
               "--node", str(node), "--port", str(self.port or 0),
               "--fd", str(reserved.fileno()),
               "--parent-pid", str(os.getpid()), "--stacks-fd", str(theirs.fileno()),
               "--say-fd", str(news_w), "--ranks-wait-s", str(ranks_wait_s)]
        if unix:
            cmd += ["--ipc", str(unix_path)]
        if secret_file is not None:
            cmd += ["--secret-file", str(secret_file)]
        if secret_store:
            cmd += ["--secret-store", secret_store]
        child_env = {k: v for k, v in os.environ.items() if k != env.SECRET}
        if secret:  # in the environment, never on a command line others can read
            child_env[env.SECRET] = secret
        with reserved, theirs, folders.open_private(log_path) as log:
            # Its own session: the terminal's Ctrl-C reaches the launcher, which stops
            # the relay only after the ranks' last messages went through it.
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                         env=child_env, start_new_session=True,
                                         pass_fds=(reserved.fileno(), theirs.fileno(),
                                                   news_w))
        os.close(news_w)  # the relay's now: the pipe ends when the relay does
        threading.Thread(target=self._read_news, args=(news,), name="traceml-relay-news",
                         daemon=True).start()

    def _read_news(self, fd: int) -> None:
        with open(fd, "rb") as pipe:
            for raw in pipe:
                line = clean_line(raw.decode(errors="replace").strip())[:500]
                if not line:
                    continue
                if len(self.said) < 1_000:
                    self.said.append(line)
                if self._say is not None:
                    self._say(line)

    def failure(self) -> str | None:
        """One line when the relay ended on its own with an error (it could not start or
        died): this node's ranks then never reach node 0. None while it runs or after a
        clean stop."""
        code = self.proc.poll()
        if code in (None, 0) or self.stopping:
            return None
        try:
            with open(self.log_path, errors="replace") as f:
                lines = [ln.strip() for ln in f.read()[-4000:].splitlines() if ln.strip()]
        except OSError:
            lines = []
        why = clean_line(lines[-1])[:300] if lines else f"exit code {code}"
        return (f"this node's relay stopped ({why}): node 0 does not see this node's ranks; "
                f"the job goes on (log: {self.log_path})")

    def stop(self, timeout: float = 5.0) -> int | None:
        """Flush and stop; the exit code (None if it had to be killed). The Unix
        socket's file goes with it."""
        self.stopping = True
        try:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    return self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
                    return None
            return self.proc.returncode
        finally:
            if self.unix_path is not None:
                try:
                    self.unix_path.unlink()
                except OSError:
                    pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m traceml_tui.collect.relay",
                                description="Forward this node's ranks to the collector.")
    p.add_argument("--upstream", required=True, help="the collector's ingest address")
    p.add_argument("--node", type=int, required=True)
    p.add_argument("--port", type=int, required=True, help="the loopback port to listen on")
    p.add_argument("--ipc", default=None, metavar="PATH",
                   help="a Unix socket to listen on instead of --port (--fd: it, bound)")
    p.add_argument("--fd", type=int, default=None,
                   help="an inherited socket already bound to --port and listening")
    p.add_argument("--secret-file", default=None, metavar="PATH",
                   help="a shared run folder's secret.key, polled for while waiting")
    p.add_argument("--secret-store", default=None, metavar="HOST:PORT",
                   help="where to fetch the run's secret if $TRACEML_SECRET is not set")
    p.add_argument("--stacks-fd", type=int, default=None,
                   help="an inherited SOCK_SEQPACKET socket to the launcher, for stacks")
    p.add_argument("--parent-pid", type=int, default=None,
                   help="the launcher's pid: when it is gone, flush and exit")
    p.add_argument("--say-fd", type=int, default=None,
                   help="an inherited pipe for lines meant for the node's terminal")
    p.add_argument("--ranks-wait-s", type=float, default=RANKS_WAIT_S,
                   help="say so when no rank has reached the relay after this long")
    return p


def _sayer(fd: int | None) -> Callable[[str], None]:
    """A line to the log and to the launcher's pipe, never blocking: a line that does
    not fit in the pipe is in the log only."""
    if fd is not None:
        os.set_blocking(fd, False)

    def say(line: str) -> None:
        print(f"[traceml] relay: {line}", file=sys.stderr, flush=True)
        if fd is not None:
            try:
                os.write(fd, (line + "\n").encode())
            except OSError:  # full, or the launcher is gone
                pass

    return say


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    descriptors.raise_limit()  # every connection to its port costs a descriptor
    halt = threading.Event()

    def stopping() -> bool:
        if args.parent_pid and os.getppid() != args.parent_pid:
            halt.set()
        return halt.is_set()

    signal.signal(signal.SIGTERM, lambda *_: halt.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher tells us when to stop
    try:
        secret = _secret(args.secret_store, stopping, args.secret_file)
    except (ValueError, keys.SecretError) as exc:
        print(f"[traceml] relay: {exc}", file=sys.stderr, flush=True)
        return 2
    if secret is None and not halt.is_set():
        print(f"[traceml] relay: no run secret ({env.SECRET} or --secret-store)",
              file=sys.stderr, flush=True)
        return 2
    if halt.is_set():
        return 0
    ctx = zmq.Context(io_threads=1)
    run_keys = keys.derive(secret) if secret else None
    auth = start_authenticator(ctx, run_keys) if run_keys is not None else None
    try:
        stacks = (None if args.stacks_fd is None
                  else socket.socket(fileno=args.stacks_fd))
        relay = Relay(ctx, args.upstream, args.node, run_keys, args.port, args.fd, stacks,
                      _sayer(args.say_fd), args.ranks_wait_s, args.ipc)
    except zmq.ZMQError as exc:
        where = args.ipc or f"127.0.0.1:{args.port}"
        print(f"[traceml] relay: cannot start (listening on {where}, sending "
              f"to {args.upstream}): {exc}",
              file=sys.stderr, flush=True)
        return 2
    print(f"[traceml] relay for node {args.node}: {relay.address} -> {args.upstream}",
          file=sys.stderr, flush=True)
    try:
        relay.serve(stopping)
    finally:
        relay.close()
        if auth is not None:
            auth.stop()
        ctx.term()
    print(f"[traceml] relay for node {args.node}: forwarded {relay.forwarded} messages in "
          f"{relay.batches} batches, dropped {relay.dropped}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
