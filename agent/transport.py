"""The agent's sender thread: batches step records and ships them to the collector.

The training thread only appends tuples to a bounded deque. Everything else
happens here, about ten times a second: converting nanoseconds to milliseconds,
deriving the residual "wait", encoding msgpack and a non-blocking ZeroMQ send.
When the collector is slow, missing or dead, messages queue up to the socket's
high-water mark and are then dropped and counted; training never waits.

The socket is a DEALER (the collector's is a ROUTER), so a later version can
send requests back to a rank over the same connection.
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
import threading
import time
from collections import deque
from time import perf_counter_ns
from typing import Any

from . import gcwatch, handover, keys, nccl_log, protocol
from .capture import Capturer
from .checks import StepObserver
from .recorder import BACKWARD, MEASURED, SYNC, Recorder
from .sysmetrics import SystemSampler
from .vocab import WARMUP_STEPS

# Distinct (group, op, phase) keys of one batch's collectives; the rest go to "other".
MAX_BATCH_KEYS = 16
BACKWARD_NAME = MEASURED[BACKWARD]
SEND_INTERVAL_S = 0.1  # step batches at most ~10 a second per rank, in a small job
HEARTBEAT_INTERVAL_S = 1.0  # liveness and progress: a rank silent 5 s is gone (hang.py)
SYS_INTERVAL_S = 1.0  # system samples (CPU, memory, GPU), up to 1,024 ranks
# The job's ranks together send node 0's collector at most about this many step batches
# a second: past 512 ranks each rank's batches space out with the world size (0.2 s at
# 1,024 ranks, up to one a second from 5,120; faster steps are batched). Each message
# costs the collector ~25 us of its core through its socket (libzmq's I/O thread, the
# ingest pump, decode and ingest: benchmarks/collector_ingest.py), so 5,120 batches a
# second plus the heartbeats and samples stay under a quarter of it; a batch a tenth of a
# second is worth nothing a half-second evaluation (collector.EVAL_INTERVAL_S) can show.
# The training thread does not change; only how often this thread sends.
STEP_BATCHES_PER_S = 5_120
MAX_SEND_INTERVAL_S = 1.0
# Past 1,024 ranks system samples come every 5 s, and so do the heartbeats of a rank
# whose step batches flow (they already say it is alive and stepping; a heartbeat's
# phase and counters matter when it stops): a rank that sent no batch since the last
# heartbeat's turn beats every second, so none is ever silent for 2 s (hang.py's 5 s).
SCALE_RANKS = 1024
LARGE_SYS_INTERVAL_S = 5.0
LARGE_BEAT_INTERVAL_S = 5.0
# At exit, the training thread's CPU shares from the last sample to its last step are
# sent when that interval is at least this long: a job shorter than two samples has no
# other (its CPU wait, judge/evidence.cpu_wait), and a shorter one is too few scheduler
# ticks to be a share.
FINAL_SYS_MIN_S = 0.25


def send_interval_s(world_size: int) -> float:
    """Seconds between step batches for a rank of a job of this size."""
    return min(MAX_SEND_INTERVAL_S, max(SEND_INTERVAL_S, world_size / STEP_BATCHES_PER_S))


def stepping_beat_s(world_size: int) -> float:
    """Seconds between heartbeats of a rank whose step batches go out (one that sent
    none since the last heartbeat's turn beats every HEARTBEAT_INTERVAL_S)."""
    return HEARTBEAT_INTERVAL_S if world_size <= SCALE_RANKS else LARGE_BEAT_INTERVAL_S


def sys_interval_s(world_size: int) -> float:
    return SYS_INTERVAL_S if world_size <= SCALE_RANKS else LARGE_SYS_INTERVAL_S
SEND_HWM = 2_000  # messages queued in ZeroMQ before sends drop (~3 min of batches)
GOODBYE_LINGER_MS = 500  # at exit, how long queued messages may take to leave
# A rank that closed no step for this long (and for STACK_STEPS of its last step times)
# sends every thread's stack, then again every STACK_REFRESH_S while it stays stuck:
# the evidence is on the collector before it declares a hang.
STACK_MIN_S = 3.0
STACK_STEPS = 5
STACK_REFRESH_S = 30.0


class Sender(threading.Thread):
    def __init__(
        self,
        endpoint: str,
        ident: protocol.Identity,
        rec: Recorder,
        out: deque,
        hello: dict[str, Any],
        secret: str | None = None,
        observer: StepObserver | None = None,
        capturer: Capturer | None = None,
        secret_store: str | None = None,
    ) -> None:
        super().__init__(name="traceml-sender", daemon=True)
        self.endpoint = endpoint
        self.identity = ident
        self.rec = rec
        self.out = out
        self.hello = hello
        self.secret = secret
        self.secret_store = secret_store  # host:port to fetch the secret from (handover.py)
        self.observer = observer
        self.capturer = capturer
        self.stop_event = threading.Event()
        # Held until stop(): the loop sleeps in its acquire(timeout=...), one C call per
        # wake (Event.wait is a few Python frames, ~16k instructions, ten times a second).
        self._stopped = threading.Lock()
        self._stopped.acquire()
        self.exit_code: int | None = None
        self.error: str | None = None
        # This process's key: its rank's record is continued from another connection only
        # by a message that carries it (a reconnect); never printed or written.
        self.key = secrets.token_hex(16)
        self.seq = 0
        self.dropped = 0  # records lost: deque overflow, device backlog, full socket
        self.sent_records = 0
        self.last_step = -1
        # Wall time of the steps taken off the queue since the last sys sample (ns): how
        # much of the sample's interval the rank spent stepping (Sys.stepping_pct).
        self.stepped_ns = 0
        self.stacks_sent_at = 0.0  # monotonic time of the last stacks message
        self.stacks_step = -1  # the step count when they were taken
        self.agent_off: str | None = None  # why timing was turned off, once it was
        self._moved = (0, 0)  # graph replays and batches at the last heartbeat
        self._sync_rest = 0.0  # sync ms not yet put down to a call or to DDP (_colls)
        # Wall clock of perf_counter_ns()'s zero, to stamp records in epoch seconds.
        self._epoch0 = time.time() - perf_counter_ns() / 1e9

    # --- thread -------------------------------------------------------------------

    def run(self) -> None:
        try:
            import zmq
        except Exception as exc:  # pragma: no cover - pyzmq is a dependency
            print(f"[traceml] agent: pyzmq unavailable ({exc}); not reporting", file=sys.stderr)
            return
        if not self.secret and self.secret_store:
            # Another node's launcher holds the secret: wait for it here, never on the
            # training thread (its steps queue meanwhile).
            try:
                self.secret = handover.fetch_secret(self.secret_store,
                                                    self.stop_event.is_set)
            except (ValueError, keys.SecretError) as exc:
                print(f"[traceml] agent: {exc}; not reporting", file=sys.stderr)
                return
            if self.secret is None:
                return  # the run ended first
        # A context of our own, terminated before this thread ends: no libzmq thread may
        # outlive it, or the interpreter's exit can abort in a C++ destructor.
        ctx = zmq.Context(io_threads=1)
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        sock.setsockopt(zmq.LINGER, 0)
        if self.secret:
            if not zmq.has("curve"):
                print("[traceml] agent: this pyzmq has no CURVE support; not reporting",
                      file=sys.stderr)
                sock.close()
                ctx.term()
                return
            keys.secure_client(sock, keys.derive(self.secret))
        sock.connect(self.endpoint)
        self._zmq_again = zmq.Again
        self._noblock = zmq.NOBLOCK
        self._sock = sock
        self._poll_in = [(sock, zmq.POLLIN)]  # zmq_poll directly: Socket.poll builds a Poller
        self._zmq_poll = zmq.zmq_poll
        sampler = SystemSampler()
        world = self.identity.world_size
        interval, sys_every = send_interval_s(world), sys_interval_s(world)
        # Wake often enough for heartbeats and capture requests even when step batches
        # are spaced out; send steps only when their interval is due.
        wake = min(interval, HEARTBEAT_INTERVAL_S / 4)
        beat_every = stepping_beat_s(world)
        try:
            self._send("hello", **self.hello, key=self.key)
            next_steps = next_sys = next_beat = last_beat = 0.0
            batched = False  # a step batch went out since the last heartbeat's turn
            sys_step = wake_step = -1  # the step count at the last sys sample, last wake
            while not self._stopped.acquire(timeout=wake):
                now = time.monotonic()
                step = getattr(self.rec, "step", 0)
                sampler.prime(getattr(self.rec, "thread", None), step != wake_step)
                wake_step = step
                if now >= next_steps:
                    next_steps = now + interval
                    batched = self._send_steps() or batched
                self._send_checks()
                self._serve_captures()
                if now >= next_sys:
                    next_sys = now + sys_every
                    # The recorder learns the device on the training thread (device.py);
                    # NVML is opened then, by the UUID torch reported for it there.
                    index = getattr(self.rec, "device", None)
                    if index is not None and sampler.cuda_index != index:
                        sampler.open_gpu(index, getattr(self.rec, "device_uuid", None))
                    step = getattr(self.rec, "step", 0)
                    self._send("sys", **sampler.sample(getattr(self.rec, "thread", None),
                                                       step != sys_step, self._stepped_s()))
                    sys_step = step
                if now >= next_beat:
                    next_beat = now + HEARTBEAT_INTERVAL_S
                    if not batched or now - last_beat >= beat_every:
                        last_beat = now
                        self._heartbeat()
                    batched = False
            self._send_steps()
            self._send_checks()
            sampler.prime(getattr(self.rec, "thread", None), self.rec.step != wake_step)
            last = (sampler.exit_sample(FINAL_SYS_MIN_S, self._stepped_s())
                    if self.rec.step != sys_step else None)
            if last is not None:
                self._send("sys", **last)
            # The last counters (the advice's GC and loader evidence grew since the last
            # beat: up to a second of a short run), without the stuck-rank stacks.
            self._heartbeat(final=True)
            self._send(
                "goodbye", exit_code=self.exit_code, error=self.error, steps=self.rec.step
            )
            sock.setsockopt(zmq.LINGER, GOODBYE_LINGER_MS)
        except Exception as exc:
            print(f"[traceml] agent sender stopped: {exc!r}", file=sys.stderr)
        finally:
            sampler.close()
            sock.close()
            ctx.term()

    def stop(self, exit_code: int | None, error: str | None, timeout: float = 5.0) -> None:
        self.exit_code, self.error = exit_code, error
        if not self.stop_event.is_set():
            self.stop_event.set()
            try:
                self._stopped.release()
            except RuntimeError:  # released already (stop() raced with itself)
                pass
        if self.is_alive():
            self.join(timeout)

    # --- messages -----------------------------------------------------------------

    def _send(self, kind: str, **body: Any) -> bool:
        payload = protocol.encode(kind, self.identity, self.seq, time.time(), **body)
        self.seq += 1
        try:
            self._sock.send(payload, flags=1)  # zmq.NOBLOCK
            return True
        except self._zmq_again:
            return False

    def _nccl(self) -> dict[str, Any]:
        try:
            return _own_nccl_state()
        except Exception:  # evidence only: never worth the stacks themselves
            return {}

    def _heartbeat(self, final: bool = False) -> None:
        rec = self.rec
        phase, in_phase = rec.in_phase()
        since_step = max(0.0, (perf_counter_ns() - rec.last_step_t) / 1e9)
        # Progress a step count cannot show (CUDA graph replays, batches fetched on any
        # thread) and the recorder's timing faults: read as plain attributes, whichever of
        # them this recorder has, so the heartbeat never fails on a missing one.
        moved = (_count(getattr(rec, "replays", 0)), _count(getattr(rec, "batches", 0)))
        busy = _line(getattr(rec, "agent_busy", None))
        self._send("heartbeat", step=rec.step, phase=phase, in_phase_s=in_phase,
                   collectives=rec.collectives, in_collective=rec.in_collective,
                   groups=dict(rec.groups), in_group=rec.in_group, grad_bytes=rec.grad_bytes,
                   since_step_s=since_step, parallel=rec.parallel, framework=framework(),
                   agent_off=self.agent_off, replays=moved[0], batches=moved[1],
                   timing_faults=_count(getattr(rec, "timing_faults", 0)),
                   capture_skips=_count(getattr(rec, "capture_skips", 0)),
                   agent_busy=busy, device_rule=_line(getattr(rec, "device_rule", None)),
                   late_steps=_count(getattr(rec, "late_steps", 0)),
                   key=self.key, **_advice_evidence(self.observer, rec.step))
        if self.agent_off is not None or final:
            return  # no steps will come: no stall, no stacks
        progressed, self._moved = moved != self._moved, moved
        if progressed or busy is not None:
            return  # replaying graphs, fetching batches or stopping a trace: not stuck
        stuck_after = max(STACK_MIN_S, STACK_STEPS * rec.last_wall / 1e9)
        now = time.monotonic()
        if since_step > stuck_after and (rec.step != self.stacks_step
                                         or now - self.stacks_sent_at > STACK_REFRESH_S):
            # A new stall (the rank stepped since the last stacks), or a refresh.
            self.stacks_sent_at, self.stacks_step = now, rec.step
            self._send("stacks", stacks=thread_stacks(), **self._nccl())

    def _serve_captures(self) -> None:
        """Requests from the collector (the DEALER hears its ROUTER), then the capture's
        progress back. A malformed request is ignored: only the collector can send one."""
        capturer = self.capturer
        if capturer is None:
            return
        sock = self._sock
        while self._zmq_poll(self._poll_in, 0):
            try:
                capture_id, steps = protocol.decode_capture_request(sock.recv(self._noblock))
            except (protocol.ProtocolError, self._zmq_again):
                continue
            if not capturer.request(capture_id, steps):
                self._send("capture", capture_id=capture_id, state="refused", steps=steps,
                           path=None, error="a capture is already running on this rank")
        while capturer.events:
            self._send("capture", **capturer.events.popleft())

    def _send_checks(self) -> None:
        """Setup findings as they are made, and once this rank's facts for the collector's
        cross-rank comparisons (weights checksum, device)."""
        obs = self.observer
        if obs is None:
            return
        findings = obs.drain()
        facts = obs.take_facts()
        if findings or facts:
            self._send("checks", findings=[f.to_wire() for f in findings], facts=facts)

    def _send_steps(self) -> bool:
        """The records closed since the last batch, as one steps message; whether one went
        out (none closed, or ZeroMQ's queue full: False)."""
        out = self.out
        if not out:
            return False
        names = list(self.rec.names)
        forced = list(self.rec.forced)
        forced.extend([0] * (len(names) - len(forced)))
        records = self._wire_records(out, len(names))
        std = len(MEASURED)
        colls = self._colls(records)
        ok = self._send(
            "steps",
            phases=[*protocol.PHASES, *names[std:]],
            records=records,
            dropped=self.dropped,
            forced=[*forced[:std], 0, *forced[std:]],  # "wait" is derived: never forced
            **({"colls": colls} if colls else {}),
        )
        if ok:
            self.sent_records += len(records)
        else:
            self.dropped += len(records)
        return ok

    def _colls(self, rows: list[list]) -> list[list]:
        """The batch's collectives as the wire's rows (protocol.CollRow): the steps' tables
        (recorder.account) merged per key, at most MAX_BATCH_KEYS and "other"; and the
        sync the hooks did not see a call for (DDP's reducer waiting for its gradient
        all-reduce, in backward) as one more row: the rows' sync minus the explicit calls'
        exposed time, carried over batches (on a GPU the records lag the tables)."""
        rec = self.rec
        names = rec.names
        merged: dict[tuple[str, str, str], list[int]] = {}
        tables = rec.coll_out
        while tables:
            for (group, op, phase), (count, nbytes, ns) in tables.popleft().items():
                key = (group, op, names[phase] if 0 <= phase < len(names) else "none")
                if key not in merged and len(merged) >= MAX_BATCH_KEYS:
                    key = ("other", "other", "none")
                entry = merged.setdefault(key, [0, 0, 0])
                entry[0] += count
                entry[1] = -1 if nbytes < 0 or entry[1] < 0 else entry[1] + nbytes
                entry[2] += ns
        col = 3 + SYNC
        synced = [r[col] for r in rows if r[col] is not None]
        explicit_ms = sum(e[2] for e in merged.values()) / 1e6
        self._sync_rest = rest = self._sync_rest + sum(synced) - explicit_ms
        wire = [[g, op, ph, c, None if b < 0 else b, ns / 1e6]
                for (g, op, ph), (c, b, ns) in merged.items()]
        if rec.parallel is None:  # no reducer (yet): backward's sync is no one's row
            self._sync_rest = 0.0
        elif rest > 0 and synced:
            ddp = rec.parallel == "ddp"
            wire.append([rec.ddp_group if ddp else "unknown",
                         "all_reduce" if ddp else "gradient_sync", BACKWARD_NAME, len(synced),
                         rec.grad_bytes * len(synced) if ddp and rec.grad_bytes else None,
                         rest])
            self._sync_rest = 0.0
        return wire

    def _wire_records(self, out: deque, n_names: int) -> list[list]:
        """The queued records as the wire's rows: [step, t_end (epoch s), wall ms, the
        measured phases in ms, wait ms, custom phases]. Written as one plain loop: this
        runs once per training step on the job's CPUs (a call, a comprehension and a
        generator per record cost ~4x as much)."""
        std = len(MEASURED)
        epoch0 = self._epoch0
        last = self.last_step
        dropped = stepped = 0
        rows = []
        popleft = out.popleft
        while out:
            step, t_end_ns, wall_ns, acc = popleft()
            if step > last + 1:
                dropped += step - last - 1
            last = step
            if step >= WARMUP_STEPS:  # the steps the diagnosis reads
                stepped += wall_ns
            wall_ms = wall_ns / 1e6
            row = [step, epoch0 + t_end_ns / 1e9, wall_ms]
            measured = 0.0
            for v in acc:
                if v is None:
                    row.append(None)
                else:
                    ms = v / 1e6
                    measured += ms
                    row.append(ms)
            row.extend([None] * (n_names - len(acc)))
            row.insert(3 + std, max(0.0, wall_ms - measured))  # wait: derived
            rows.append(row)
        self.last_step = last
        self.dropped += dropped
        self.stepped_ns += stepped
        return rows

    def _stepped_s(self) -> float:
        """Seconds of steps taken off the queue since the last call (a sys sample's)."""
        ns, self.stepped_ns = self.stepped_ns, 0
        return ns / 1e9


def _count(value: object) -> int:
    """A recorder's counter as the wire's bounded count (0 for anything else)."""
    if type(value) is not int:
        return 0
    return min(max(value, 0), protocol.MAX_COUNT)


def _line(value: object) -> str | None:
    """A recorder's short text as the wire's bounded line (None for anything else)."""
    return value[: protocol.MAX_STR] if isinstance(value, str) and value else None


# Training frameworks recognised by their modules, most specific first (Transformers
# imports Accelerate): named in the hint when a phase cannot be timed.
FRAMEWORKS = (("lightning", "PyTorch Lightning"), ("pytorch_lightning", "PyTorch Lightning"),
              ("transformers", "Hugging Face Transformers"),
              ("accelerate", "Hugging Face Accelerate"), ("deepspeed", "DeepSpeed"))


def framework() -> str | None:
    """The training framework this process imported, if any (a few dict lookups)."""
    modules = sys.modules
    for module, name in FRAMEWORKS:
        if module in modules:
            return name
    return None


def _own_nccl_state() -> dict[str, Any]:
    """With `traceml run --nccl-debug`: what this rank's own NCCL log says of its last
    collectives (nccl_log.py), read here, off the training thread."""
    state = nccl_log.read_own(os.environ.get(nccl_log.LOG_DIR_ENV), socket.gethostname(),
                              os.getpid())
    return {} if state is None else {"nccl": state.to_wire()}


def thread_stacks() -> list[list[str]]:
    """Every thread's Python stack, innermost call last, taken from this thread: the
    stuck thread is not asked for anything (it may be blocked inside a collective)."""
    import traceback

    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    out = []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        text = "".join(traceback.format_stack(frame))[-protocol.MAX_STACK_CHARS:]
        out.append([names.get(ident, f"thread {ident}")[:128], text])
    out.sort(key=lambda item: item[0] != "MainThread")  # the training thread first
    return out[: protocol.MAX_THREADS]


def _advice_evidence(observer: StepObserver | None, step: int) -> dict[str, Any]:
    """The heartbeat's evidence for a stall's advice: this process's garbage-collection
    pauses since training began (gcwatch.py: armed at the first heartbeat after a step)
    and the training DataLoader the observer saw; empty on a failure (evidence only:
    never worth the heartbeat)."""
    try:
        out: dict[str, Any] = {}
        watch = gcwatch.current()
        if watch is not None and not watch.armed and step > 0:
            watch.armed = True
        if watch is not None:
            out.update(gc_slow=watch.slow, gc_slow_ms=watch.slow_ms, gc_max_ms=watch.max_ms,
                       gc_full=watch.full)
        if observer is not None and observer.loader_epochs:
            out.update(loader_len=observer.loader_len, loader_epochs=observer.loader_epochs,
                       loader_workers=observer.loader_workers,
                       loader_persistent=observer.loader_persistent)
        return out
    except Exception:
        return {}
