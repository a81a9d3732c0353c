"""Stacks of ranks stuck in native code, taken from outside the process.

A rank inside a C call that holds the GIL (a stuck NCCL call, a deadlocked extension, a
hung cudaMemcpy) cannot run its agent's thread: it sends no stack and goes silent. While
the collector reports a hang, the `traceml run` of the culprit's node (the ranks'
ancestor, which Linux's Yama ptrace rule lets inspect them) takes its Python and native
stack with `py-spy dump --native`. Node 0's hands it to the collector (NativeStackWatcher,
over the control socket, with the launcher's key); another node's is asked by its relay,
which the collector asked, and answers through it (NodeStackServer: the relay's
connection to node 0, where the collector takes it only for that relay's own ranks).
The hang report shows it (docs/hangs.md). Best effort: without py-spy, or where ptrace is
forbidden, nothing changes.

The pid comes from the rank's own hello, which any key holder can forge: it is dumped
only when /proc shows it a descendant of the torchrun this launcher started (so a
process of this run), never on the rank's word; every other request is refused and
counted (the summary's run.native_stack_refused). Yama's ptrace scope is no fence on
machines without Yama, nor for a launcher run as root (common in ML containers).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from msgspec.structs import replace

from traceml_agent.protocol import (
    ProtocolError,
    RelayStackRequest,
    RelayStacks,
    decode_relay_stacks,
    encode_relay_stacks,
)
from traceml_agent.requests import (
    NATIVE_STACK_MAX,
    ControlReply,
    NativeStack,
    RequestError,
    decode_control_reply,
    encode_control,
)
from traceml_tui.collect.lineage import descends_from, parent_pid  # noqa: F401 (re-exported)
from traceml_tui.runfolder import summary_model as model
from traceml_tui.runfolder.layout import RunFolder

DUMP_TIMEOUT_S = 20.0
POLL_S = 1.0


def dump(pid: int, py_spy: str | None = None) -> str | None:
    """The process' threads, Python and native frames, as py-spy prints them; None if it
    could not be read (no py-spy, no permission, the process is gone)."""
    exe = py_spy or shutil.which("py-spy")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, "dump", "--native", "--pid", str(pid)], capture_output=True,
                              text=True, timeout=DUMP_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0 or not done.stdout.strip():
        return None
    return done.stdout[:NATIVE_STACK_MAX]  # the collector refuses more


def stuck_ranks(doc: model.Summary, node: int) -> list[tuple[int, int]]:
    """(rank, pid) of this node's ranks that a live snapshot's hang names and that sent
    no stack of their own."""
    hang = doc.hang
    if hang is None:
        return []
    named = set(hang.ranks)
    return [(r.rank, r.pid) for r in doc.ranks
            if r.rank in named and r.node == node and str(r.rank) not in hang.stacks
            and r.pid is not None and r.pid > 0]


class NativeStackWatcher(threading.Thread):
    """Watches the run's live snapshot; when a hang names ranks of this node without a
    stack, dumps them once per hang and sends each to the collector (`send`)."""

    def __init__(self, run_dir: Path, node: int,
                 send: Callable[[NativeStack], ControlReply | None], stop: threading.Event,
                 torchrun_pid: int, py_spy: str | None = None) -> None:
        super().__init__(name="traceml-native-stacks", daemon=True)
        self.run_dir = run_dir
        self.node = node
        self.send = send
        self.stop = stop
        self.torchrun_pid = torchrun_pid  # only its descendants are ever dumped
        self.py_spy = py_spy or shutil.which("py-spy")
        self.done: set[tuple[int, str]] = set()  # (rank, hang since): dumped already
        self.refused = 0  # pids named that are not a process of this run

    def run(self) -> None:
        if self.py_spy is None:
            return
        while not self.stop.wait(POLL_S):
            try:  # bounded and validated: the folder is the user's, the file the collector's
                doc = model.load(RunFolder(self.run_dir).live)
            except (OSError, model.NotASummary):
                continue
            since = str(doc.hang.since if doc.hang else None)
            for rank, pid in stuck_ranks(doc, self.node):
                if (rank, since) in self.done:
                    continue
                self.done.add((rank, since))
                if not descends_from(pid, self.torchrun_pid):
                    self.refused += 1  # a forged hello's pid: never ptraced
                    continue
                text = dump(pid, self.py_spy)
                if text is not None:
                    self.send(NativeStack(rank=rank, pid=pid, text=text))


REDUMP_S = 30.0  # the same rank and pid is dumped again at most this often


class NodeStackServer(threading.Thread):
    """Another node's side: answers its relay's stack requests (the collector's, for this
    node's ranks in a hang) with `py-spy dump --native` of that pid, when /proc shows it a
    descendant of this node's torchrun; every other pid is refused and counted."""

    def __init__(self, sock: socket.socket, node: int, stop: threading.Event,
                 torchrun_pid: int, py_spy: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(name="traceml-node-stacks", daemon=True)
        self.sock = sock
        self.node = node
        self.stop = stop
        self.torchrun_pid = torchrun_pid
        self.py_spy = py_spy or shutil.which("py-spy")
        self.clock = clock
        self.last: dict[tuple[int, int], float] = {}  # (rank, pid) -> when dumped
        self.refused = 0
        self.sent = 0

    def run(self) -> None:
        self.sock.settimeout(POLL_S)
        while not self.stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return  # the relay is gone
            if not data:
                return
            try:
                request = decode_relay_stacks(data)
            except ProtocolError:
                continue
            if isinstance(request, RelayStackRequest):
                self.answer(request)

    def answer(self, request: RelayStackRequest) -> None:
        key, now = (request.rank, request.pid), self.clock()
        if now - self.last.get(key, -REDUMP_S) < REDUMP_S:
            return
        if len(self.last) > 4096:  # bounded: a node runs a few dozen ranks
            self.last.clear()
        self.last[key] = now
        if not descends_from(request.pid, self.torchrun_pid):
            self.refused += 1  # a forged hello's pid: never ptraced
            return
        text = dump(request.pid, self.py_spy)
        if text is None:
            return
        try:
            self.sock.send(encode_relay_stacks(RelayStacks(self.node, request.rank,
                                                           request.pid, text)))
            self.sent += 1
        except OSError:
            pass


def control_sender(control: str, secret: str, control_key: str, timeout_s: float = 5.0
                   ) -> Callable[[NativeStack], ControlReply | None]:
    """A function that sends one request to the collector's control socket (CURVE, as
    the launcher's own requests, with the launcher's control key) and waits briefly for
    its answer (None: none came, or not one the collector gives)."""
    import zmq

    from traceml_agent import keys

    def send(request: NativeStack) -> ControlReply | None:
        sock: zmq.Socket = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        keys.secure_client(sock, keys.derive(secret))
        sock.connect(control)
        try:
            sock.send(encode_control(replace(request, key=control_key)))
            if not sock.poll(int(timeout_s * 1000)):
                return None
            return decode_control_reply(sock.recv())
        except (zmq.ZMQError, RequestError):
            return None
        finally:
            sock.close()

    return send
