"""The wire protocol between the per-rank agents and the collector.

This is the only module that knows how messages look on the wire. Both sides
import it: the agent to encode, the collector to decode and validate. Messages
are msgpack maps (never pickle: a collector must be safe to expose to a socket),
described once as msgspec Structs (below): the decoder checks every type and bound,
refuses unknown fields, NaN and infinities, and a malformed or hostile message is
rejected with a `ProtocolError` instead of reaching the collector's state.

Every message carries the protocol version ``v``, its ``kind``, the sender's
identity ``id`` (rank, local rank, node, host, pid, world size), a per-sender
sequence number ``seq`` and the sender's wall clock ``t`` (epoch seconds).
Carrying the identity in every message (a few dozen bytes) means a collector
that starts late, or restarts, can place any message without having seen the
sender's hello.

Kinds:
  hello      once at start: run name, device, distributed env, and whether the
             zero-code hooks time the loop (`auto`)
  steps      a batch of per-step records (an agent sends at most ~10 a second), with
             `forced`: per phase, how many times it was closed for lack of an end hook,
             and `colls`: its steps' collectives per (group, op, phase issued in)
  sys        a system sample: CPU %, RSS, GPU utilisation and memory, and the CUDA
             device once the agent has learned it
  heartbeat  liveness and progress, from a thread that does not need training: step,
             phase, collectives launched, seconds since the last step, the training
             framework seen in the process (for the hint when a phase cannot be timed),
             CUDA graph replays and DataLoader batches (progress a step count cannot
             show), timing faults and capture skips, what keeps the agent busy, and the
             rule that chose the timing device
  stacks     every thread's Python stack, sent by a rank that stopped making progress
  goodbye    at exit: exit code and the tail of a traceback, if any
  checks     setup mistakes found in this rank (checks.py), and once its facts for the
             collector's cross-rank comparisons (weights checksum, device)
  capture    progress of a deep-trace capture (capture.py): started, done (with the
             trace file's path), failed or refused

And one request goes the other way, collector to agent, on the same connection:
  {"op": "capture", "id": N, "steps": S}   profile the next S steps (encode_capture_request)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType
from msgspec.structs import asdict, force_setattr

from . import vocab
from .findings import Finding, facts_from_wire
from .sanitize import clean_line, clean_text

# 3: the wire is described by the msgspec Structs below (same msgpack maps as 2, whose
# fields it keeps); 2 added steps `forced`, hello `auto`, heartbeat `framework` and
# `agent_off`.
PROTOCOL_VERSION = 3

# The phases of one optimizer step, in wire order (vocab.py says what each is).
PHASES = vocab.PHASES

KINDS = frozenset({"hello", "steps", "sys", "heartbeat", "stacks", "goodbye", "checks",
                   "capture"})
CAPTURE_STATES = frozenset({"started", "done", "failed", "refused"})
MAX_PATH = 1024

# Bounds that keep one message from costing the collector more than a sane
# agent ever sends. They are generous: a real agent sends ~10 batches a second.
MAX_MESSAGE_BYTES = 1 << 20
MAX_RECORDS_PER_BATCH = 20_000
MAX_PHASES = 24
MAX_STR = 256
MAX_WORLD_SIZE = 1 << 20
MAX_ENV_ENTRIES = 64
MAX_ERROR_CHARS = 8_000
MAX_THREADS = 32
MAX_STACK_CHARS = 6_000
MAX_FINDINGS = 32  # per message; a rank reports each of ~a dozen checks at most once
MAX_GROUPS = 33  # the agent's 32 named process groups and "other" (hooks.py)
# One step longer than a day is not a measurement, it is corruption.
MAX_STEP_MS = 86_400_000.0
MAX_COUNT = 1 << 62
# Collective rows in one steps batch: the sender's 16 keys, "other" and DDP's all-reduce.
MAX_COLL_ROWS = 18
MAX_BATCH_MS = MAX_STEP_MS * MAX_RECORDS_PER_BATCH


class ProtocolError(ValueError):
    """A message that does not follow this protocol. The collector counts and drops it."""


# --- field types: the bounds live in the type ---------------------------------------------


Count = Annotated[int, Meta(ge=0, le=MAX_COUNT)]
MAX_ATTEMPT = 1 << 20  # torchrun's --max-restarts is an int; no job restarts this often
Seconds = Annotated[float, Meta(ge=0.0, le=1e9)]  # durations (NaN and inf fail the bound)
MAX_EPOCH_S = 1e11  # a time stamp (epoch seconds) past year 5138 is no clock's
Epoch = Annotated[float, Meta(ge=0.0, le=MAX_EPOCH_S)]
Megabytes = Annotated[float, Meta(ge=0.0, le=1e9)]
Short = Annotated[str, Meta(max_length=64)]
Line = Annotated[str, Meta(max_length=MAX_STR)]
# A field flagged so (Annotated[..., SUMMARIZED]) is copied, under its name, into its
# rank's row of final_summary.json: runfolder/summary_model.py declares the row's field from the
# flag, after the row's own fields, in this Struct's order (issue 31: a field a rank
# sends reaches the summary with no edit on the collector's side).
SUMMARIZED = Meta(extra={"summary": True})
EnvValue = Annotated[str, Meta(max_length=1024)]
Tiny = Annotated[str, Meta(max_length=16)]
ThreadName = Annotated[str, Meta(max_length=128)]
StackText = Annotated[str, Meta(max_length=MAX_STACK_CHARS)]
ErrorText = Annotated[str, Meta(max_length=MAX_ERROR_CHARS)]
PathText = Annotated[str, Meta(max_length=MAX_PATH)]
UnusedText = Annotated[str, Meta(max_length=2000)]


def _clean_fields(obj: Struct, lines: tuple[str, ...] = (), texts: tuple[str, ...] = ()
                  ) -> None:
    """Replace control characters in string fields (sanitize.py), in place after decoding:
    `lines` are one-line fields, `texts` keep newlines (stacks, tracebacks)."""
    for name in lines:
        v = getattr(obj, name)
        if isinstance(v, str) and not v.isprintable():
            force_setattr(obj, name, clean_line(v))
    for name in texts:
        v = getattr(obj, name)
        if isinstance(v, str) and not v.isprintable():
            force_setattr(obj, name, clean_text(v))


class Identity(Struct, frozen=True, forbid_unknown_fields=True):
    """Who sent a message. Carried by every message, so a collector that starts late or
    restarts can place any message without having seen the sender's hello."""

    rank: Annotated[int, Meta(ge=0, lt=MAX_WORLD_SIZE)]
    local_rank: Annotated[int, Meta(ge=0, le=MAX_WORLD_SIZE)]
    node: Annotated[int, Meta(ge=0, le=MAX_WORLD_SIZE)]
    host: Line
    pid: Annotated[int, Meta(ge=0, le=1 << 31)]
    world_size: Annotated[int, Meta(ge=1, le=MAX_WORLD_SIZE)]

    def __post_init__(self) -> None:
        _clean_fields(self, lines=("host",))

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One optimizer step of one rank. ``phase_ms`` aligns with the batch's phase names;
    None means the phase was not measured on this step (never a made-up 0)."""

    step: int
    t_end: float
    step_ms: float
    phase_ms: tuple[float | None, ...]


@dataclass(frozen=True, slots=True)
class CheckReport:
    """A checks message as the collector reads it: findings and facts, validated against
    the checks this version knows (findings.py: Finding.from_wire, facts_from_wire)."""

    findings: tuple[Finding, ...]
    facts: dict[str, Any] | None  # findings.facts_from_wire


@dataclass(frozen=True, slots=True)
class Message:
    """A validated message as the collector reads it: the envelope, and the kind's decoded
    Struct (`body`: Hello, Steps, Sys, Heartbeat, Stacks, Goodbye, Capture) or, for checks,
    its validated CheckReport. The collector's state reads the Struct's typed fields."""

    kind: str
    ident: Identity
    seq: int
    t: float
    body: Body
    # Only for kind == "steps": validated records and their phase names, per phase how
    # many times it was closed without an end hook, and how many records of the batch
    # were refused (one bad record costs itself, not its batch).
    phases: tuple[str, ...] = ()
    records: tuple[StepRecord, ...] = ()
    forced: tuple[int, ...] = ()
    bad_records: int = 0


# --- the messages (agent -> collector), one Struct per kind ---------------------------------


class _Wire(Struct, tag_field="kind", forbid_unknown_fields=True, kw_only=True, frozen=True):
    v: int
    id: Identity
    seq: Count
    t: Epoch


# A process key: 32 hex digits (secrets.token_hex(16)).
ProcessKey = Annotated[str, Meta(min_length=32, max_length=32, pattern="^[0-9a-f]+$")]


class Hello(_Wire, tag="hello", kw_only=True, frozen=True):
    run: Line = ""
    device: Short = "cpu"
    backend: Short = ""
    auto: bool = True
    env: Annotated[dict[Line, EnvValue], Meta(max_length=MAX_ENV_ENTRIES)] = {}
    # torchrun's restart count (TORCHELASTIC_RESTART_COUNT: 0 in the first attempt); None
    # outside torchrun's elastic agent. The collector keeps each attempt (judge/attempts.py).
    attempt: Annotated[int, Meta(ge=0, le=MAX_ATTEMPT)] | None = None
    # The agent process's own key (random, per process; never shown in a view, summary,
    # metric or log): presented again, in a hello or heartbeat, to continue its rank's
    # record from another connection. A pid is public; this is not (state.py).
    key: ProcessKey | None = None

    def __post_init__(self) -> None:
        _clean_fields(self, lines=("run", "device", "backend"))
        if not all(k.isprintable() and v.isprintable() for k, v in self.env.items()):
            force_setattr(self, "env", {clean_line(k): clean_line(v)
                                        for k, v in self.env.items()})


class CollRow(Struct, array_like=True, forbid_unknown_fields=True, frozen=True):
    """The collectives of one (process group, op, phase it was issued in) over the steps
    of one batch: calls, this rank's input bytes (None: not known for every call) and the
    exposed wait in ms. Group names are the same on every rank (collective_names.ranks_name)."""

    group: Short
    op: Short
    phase: Short
    count: Count
    nbytes: Count | None
    exposed_ms: Annotated[float, Meta(ge=0.0, le=MAX_BATCH_MS)]

    def __post_init__(self) -> None:
        _clean_fields(self, lines=("group", "op", "phase"))


class Steps(_Wire, tag="steps", kw_only=True, frozen=True):
    phases: Annotated[list[Short], Meta(min_length=1, max_length=MAX_PHASES)]
    # Each record is [step, t_end, step_ms, *phase_ms]: checked in _records (its length
    # depends on the phases).
    records: Annotated[list[list[int | float | None]], Meta(max_length=MAX_RECORDS_PER_BATCH)]
    dropped: Count = 0
    forced: list[Count] | None = None
    # The batch's collectives, aggregated per key (not one row per call): absent from an
    # older agent, and from a batch whose steps issued none.
    colls: Annotated[list[CollRow], Meta(max_length=MAX_COLL_ROWS)] = []


# NVML's clock-throttle reasons, named (sysmetrics.THROTTLE_BITS gives their bits).
ThrottleReason = Literal["idle", "app clocks", "power cap", "hw slowdown", "sync boost",
                         "sw thermal", "hw thermal", "power brake", "display clocks"]


class Sys(_Wire, tag="sys", kw_only=True, frozen=True):
    cpu_pct: Annotated[float, Meta(ge=0.0, le=1e5)] | None = None
    # Percent of the interval the training thread ran on a CPU, and was runnable but
    # waiting for one (the kernel's run queue), over an interval in which it stepped
    # (sysmetrics.ThreadSchedule): a thread that waits much of its ready time has its
    # cores shared with other work.
    thread_cpu_pct: Annotated[float, Meta(ge=0.0, le=100.0)] | None = None
    cpu_wait_pct: Annotated[float, Meta(ge=0.0, le=100.0)] | None = None
    # Percent of that interval spent inside steps (the steps' wall time the sender took
    # off its queue since the last sample): shares of an interval mostly spent elsewhere
    # (start-up, evaluation) are not the steps' (judge/ingest.py reads them as not read).
    stepping_pct: Annotated[float, Meta(ge=0.0, le=100.0)] | None = None
    rss_mb: Megabytes | None = None
    gpu_util: Annotated[float, Meta(ge=0.0, le=100.0)] | None = None
    gpu_mem_mb: Megabytes | None = None
    gpu_mem_total_mb: Megabytes | None = None
    # This process's own figures from torch's caching allocator (sysmetrics.py).
    gpu_alloc_mb: Megabytes | None = None
    gpu_reserved_mb: Megabytes | None = None
    gpu_peak_mb: Megabytes | None = None
    # The CUDA device the rank was found to train on (it is learned after hello).
    device: Short | None = None
    # GPU health from NVML (sysmetrics.py), of the physical GPU under a MIG instance:
    # board power, SM clock and its maximum, temperature, the clock-throttle reasons now.
    power_w: Annotated[float, Meta(ge=0.0, le=1e5)] | None = None
    sm_clock_mhz: Annotated[float, Meta(ge=0.0, le=1e5)] | None = None
    sm_clock_max_mhz: Annotated[float, Meta(ge=0.0, le=1e5)] | None = None
    temp_c: Annotated[float, Meta(ge=-100.0, le=300.0)] | None = None
    throttle: Annotated[tuple[ThrottleReason, ...], Meta(max_length=16)] | None = None
    gpu_uuid: Short | None = None  # the NVML device sampled (a GPU- or MIG- UUID)
    gpu_note: Line | None = None  # why GPU figures are missing, when some are
    # Memory this rank may still take before its limit: its cgroup's limit less the
    # cgroup's usage, or the host's available memory (sysmetrics.MemoryHeadroom).
    mem_avail_mb: Megabytes | None = None
    # Sent as the process ends (Sender.run): only its thread shares are the training's,
    # from the last sample to the last step; its other figures are not read (memory at
    # exit is the teardown's), and it does not replace the rank's latest sample.
    at_exit: bool = False

    def __post_init__(self) -> None:
        _clean_fields(self, lines=("device", "gpu_uuid", "gpu_note"))

    def sample(self) -> dict[str, Any]:
        """Its figures by name, without the envelope (a summary's per-rank row)."""
        return {name: getattr(self, name) for name in self.__struct_fields__
                if name not in _ENVELOPE and name != "at_exit"}


class Heartbeat(_Wire, tag="heartbeat", kw_only=True, frozen=True):
    step: Count = 0
    phase: Short | None = None
    in_phase_s: Seconds | None = None
    collectives: Count = 0
    in_collective: Short | None = None
    # Collectives entered per process group, and the group of the one in progress.
    groups: Annotated[dict[Short, Count], Meta(max_length=MAX_GROUPS)] = {}
    in_group: Short | None = None
    # Gradient bytes DDP all-reduces per step (0: not DDP, or not known yet).
    grad_bytes: Annotated[int, Meta(ge=0, le=1 << 50)] = 0
    since_step_s: Seconds | None = None
    parallel: Tiny | None = None
    framework: Short | None = None
    agent_off: Line | None = None
    # Progress the step count cannot show, and timing the agent could not do (all optional:
    # an older agent's heartbeat decodes with the defaults). CUDA graph replays and
    # DataLoader batches (any thread) seen; event pairs that were negative or failed (their
    # phases went out as None); phases skipped inside a CUDA graph capture; what keeps the
    # agent itself busy, e.g. "deep trace stopping" while the profiler stops; and the rule
    # that chose the timing device, e.g. "current device (parameters on CPU: offload)"
    # (agent state, like agent_off: sys carries the device, the heartbeat why that one).
    replays: Annotated[Count, SUMMARIZED] = 0
    batches: Annotated[Count, SUMMARIZED] = 0
    timing_faults: Annotated[Count, SUMMARIZED] = 0
    capture_skips: Annotated[Count, SUMMARIZED] = 0
    agent_busy: Line | None = None
    device_rule: Line | None = None
    key: ProcessKey | None = None  # the hello's, again: the process proves itself with it
    # Evidence for a stall's advice (judge/advice.py), all optional. Garbage collection
    # (gcwatch.py): pauses of at least SLOW_GC_MS, their total ms, the longest pause, and
    # the full (generation-2) collections. The training DataLoader (checks.StepObserver):
    # its length in batches, the passes over it (epochs) seen so far, its worker count and
    # whether its workers persist across epochs.
    gc_slow: Count = 0
    gc_slow_ms: Annotated[float, Meta(ge=0.0, le=1e12)] = 0.0
    gc_max_ms: Annotated[float, Meta(ge=0.0, le=1e12)] = 0.0
    gc_full: Count = 0
    loader_len: Count | None = None
    loader_epochs: Count = 0
    loader_workers: Annotated[int, Meta(ge=0, le=1 << 16)] | None = None
    loader_persistent: bool | None = None
    # Steps sent on the host clock because the device was more than the recorder's
    # pending bound behind (their device phases went out as not measured; issue 40).
    late_steps: Annotated[Count, SUMMARIZED] = 0

    def __post_init__(self) -> None:
        _clean_fields(self, lines=("phase", "in_collective", "in_group", "parallel",
                                   "framework", "agent_off", "agent_busy", "device_rule"))
        if not all(k.isprintable() for k in self.groups):
            force_setattr(self, "groups", {clean_line(k): v for k, v in self.groups.items()})


class NcclState(Struct, forbid_unknown_fields=True):
    """A rank's last collectives per its own NCCL log (nccl_log.py)."""

    op: Short | None = None
    op_count: Count | None = None
    comm: Short | None = None
    done: Count | None = None
    unused: UnusedText | None = None

    def __post_init__(self) -> None:
        _clean_fields(self, lines=("op", "comm", "unused"))


class Stacks(_Wire, tag="stacks", kw_only=True, frozen=True):
    stacks: Annotated[list[tuple[ThreadName, StackText]],
                      Meta(max_length=MAX_THREADS)]
    nccl: NcclState | None | UnsetType = UNSET

    def __post_init__(self) -> None:
        if not all(name.isprintable() and text.isprintable() for name, text in self.stacks):
            force_setattr(self, "stacks", [(clean_line(name), clean_text(text))
                                           for name, text in self.stacks])


class Goodbye(_Wire, tag="goodbye", kw_only=True, frozen=True):
    exit_code: Annotated[int, Meta(ge=-(1 << 31), le=1 << 31)] | None = None
    error: ErrorText | None = None
    steps: Count = 0

    def __post_init__(self) -> None:
        _clean_fields(self, texts=("error",))


class Checks(_Wire, tag="checks", kw_only=True, frozen=True):
    # Validated against the checks this version knows (findings.Finding.from_wire).
    findings: Annotated[list[dict[Short, str | list[int]]],
                        Meta(max_length=MAX_FINDINGS)] = []
    facts: dict[Short, float | int | str | None] | None = None


class Capture(_Wire, tag="capture", kw_only=True, frozen=True):
    capture_id: Count
    state: Literal["started", "done", "failed", "refused"]
    steps: Annotated[int, Meta(ge=0, le=1 << 20)] = 0
    path: PathText | None = None
    error: ErrorText | None = None

    def __post_init__(self) -> None:
        _clean_fields(self, lines=("path",), texts=("error",))


WireMessage = Hello | Steps | Sys | Heartbeat | Stacks | Goodbye | Checks | Capture
# What a Message carries: the decoded Struct, or for checks its validated report.
Body = Hello | Steps | Sys | Heartbeat | Stacks | Goodbye | Capture | CheckReport
# The counts of a rank that has sent no heartbeat yet: every field at its default (its
# envelope names no one). Messages are frozen: the state keeps the latest Heartbeat and
# Sys whole, and the snapshots that viewers and the summary read share them.
NO_HEARTBEAT = Heartbeat(v=PROTOCOL_VERSION, id=Identity(0, 0, 0, "", 0, 1), seq=0, t=0.0)
_DECODER = msgspec.msgpack.Decoder(WireMessage)
_ENCODER = msgspec.msgpack.Encoder()
_ENVELOPE = frozenset({"v", "kind", "id", "seq", "t"})

# --- encoding (agent side) -------------------------------------------------------------


def encode(kind: str, ident: Identity, seq: int, t: float, **body: Any) -> bytes:
    """Encode one message. The caller passes plain ints, floats, strings, lists and dicts."""
    if not _ENVELOPE.isdisjoint(body):  # a body field must never replace the envelope's
        raise ValueError(f"body fields {sorted(_ENVELOPE & body.keys())} are envelope names")
    msg = {"v": PROTOCOL_VERSION, "kind": kind, "id": ident.to_wire(), "seq": seq, "t": t}
    msg.update(body)
    return _ENCODER.encode(msg)


# --- decoding and validation (collector side) ------------------------------------------


def decode(payload: bytes) -> Message:
    """Decode and validate one message, or raise ProtocolError. Never raises anything else."""
    return message(decode_wire(payload))


def decode_wire(payload: bytes) -> WireMessage:
    """The decoded Struct, every field checked by its type but a steps message's records
    (they are checked by `message`, or as columns by the collector: a large batch,
    collect/steps_columns.py). ProtocolError for anything else."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise ProtocolError("payload is not bytes")
    if len(payload) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(payload)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        wire = _DECODER.decode(payload)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"invalid message: {exc}"[:300]) from None
    except Exception as exc:  # not msgpack at all, or nested past the decoder's limit
        raise ProtocolError(f"not valid msgpack: {type(exc).__name__}") from None
    if wire.v != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {wire.v!r:.40}")
    if wire.id.rank >= wire.id.world_size:
        raise ProtocolError(f"id.rank {wire.id.rank} is not below id.world_size")
    return wire


def message(wire: WireMessage) -> Message:
    """A decoded Struct (decode_wire) as the collector reads it, records checked."""
    try:
        return _message(wire)
    except ProtocolError:
        raise
    except Exception as exc:  # a shape we did not anticipate is still just a bad message
        raise ProtocolError(f"invalid message: {type(exc).__name__}: {exc}") from None


def _message(wire: WireMessage) -> Message:
    ident = wire.id
    kind = str(type(wire).__struct_config__.tag)
    if isinstance(wire, Steps):
        phases = _phases(wire.phases)
        n = len(phases)
        if wire.forced is None:
            forced: tuple[int, ...] = (0,) * n
        elif len(wire.forced) != n:
            raise ProtocolError("forced must be a list with one count per phase")
        else:
            forced = tuple(wire.forced)
        records, refused = _records(wire.records, n)
        return Message("steps", ident, wire.seq, wire.t, wire, phases, records, forced, refused)
    if isinstance(wire, Checks):
        return Message(kind, ident, wire.seq, wire.t, _checks(wire))
    if isinstance(wire, Stacks) and wire.nccl is UNSET:
        force_setattr(wire, "nccl", None)  # the state reads None: no NCCL log sent
    return Message(kind, ident, wire.seq, wire.t, wire)


_NUMBER = (float, int)


def _records(raw: list[list[int | float | None]], n_phases: int
             ) -> tuple[tuple[StepRecord, ...], int]:
    """[step, t_end, step_ms, *phase_ms] lists as StepRecords, and how many were refused.
    A record is kept when it has an int step and finite non-negative times within their
    bounds (NaN fails every comparison). A bad record (a negative cross-stream phase from
    an older agent, say) is refused alone: its batch's other steps are real, and dropping
    them would hide ~10 steps behind one bad value."""
    out = []
    refused = 0
    for rec in raw:
        kept = _record(rec, n_phases)
        if kept is None:
            refused += 1
        else:
            out.append(kept)
    return tuple(out), refused


def _record(rec: list[int | float | None], n_phases: int) -> StepRecord | None:
    if not _record_ok(rec, n_phases):
        return None
    return StepRecord(rec[0], float(rec[1]), float(rec[2]),  # type: ignore[arg-type]
                      tuple(v if v is None else float(v) for v in rec[3:]))


def _record_ok(rec: list[int | float | None], n_phases: int) -> bool:
    if len(rec) != 3 + n_phases:  # [step, t_end, step_ms, *phase_ms]
        return False
    step, t_end, step_ms = rec[0], rec[1], rec[2]
    if type(step) is not int or not 0 <= step <= MAX_COUNT:
        return False
    if type(t_end) not in _NUMBER or not 0.0 <= t_end <= MAX_EPOCH_S:  # type: ignore[operator]
        return False
    if type(step_ms) not in _NUMBER or not 0.0 <= step_ms <= MAX_STEP_MS:  # type: ignore[operator]
        return False
    for v in rec[3:]:
        if v is not None and (type(v) not in _NUMBER or not 0.0 <= v <= MAX_STEP_MS):
            return False
    return True


# Phase-name lists seen, validated: agents send the same list in every batch.
_PHASE_LISTS: dict[tuple[str, ...], tuple[str, ...]] = {}
_MAX_PHASE_LISTS = 64


def _phases(raw: list[str]) -> tuple[str, ...]:
    key = tuple(raw)
    phases = _PHASE_LISTS.get(key)
    if phases is None:
        phases = tuple(p if p.isprintable() else clean_line(p) for p in key)
        if len(set(phases)) != len(phases):
            raise ProtocolError("phase names repeat")
        if len(_PHASE_LISTS) >= _MAX_PHASE_LISTS:  # bounded whatever senders invent
            _PHASE_LISTS.clear()
        _PHASE_LISTS[key] = phases
    return phases


def _checks(wire: Checks) -> CheckReport:
    try:
        return CheckReport(tuple(Finding.from_wire(f) for f in wire.findings),
                           None if wire.facts is None else facts_from_wire(wire.facts))
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ProtocolError(f"bad checks: {exc}") from None


# --- the one request the other way (collector -> agent) -------------------------------------


class CaptureRequest(Struct, forbid_unknown_fields=True):
    op: Literal["capture"]
    id: Count
    steps: Annotated[int, Meta(ge=1, le=1 << 20)]


_REQUEST_DECODER = msgspec.msgpack.Decoder(CaptureRequest)


def encode_capture_request(capture_id: int, steps: int) -> bytes:
    return _ENCODER.encode(CaptureRequest("capture", capture_id, steps))


def decode_capture_request(data: bytes) -> tuple[int, int]:
    """(capture id, steps) of a request from the collector. Raises ProtocolError."""
    if len(data) > 256:
        raise ProtocolError("not a capture request")
    try:
        req = _REQUEST_DECODER.decode(data)
    except Exception as exc:
        raise ProtocolError(f"not a capture request: {exc}"[:200]) from None
    return req.id, req.steps


# --- node relays (traceml_tui/collect/relay.py) -------------------------------------------------
# A relay forwards its node's ranks to the collector as one two-frame message per tick,
#   [RELAY_TAG, RelayBatch]
# whose payloads are rank messages exactly as the ranks sent them (the collector decodes
# and validates each as if its rank had sent it directly); routes[i] names the local
# connection payloads[i] came from, so a request can go back to it:
#   collector -> relay: [RELAY_TAG, route (4 bytes, big-endian), request]
# One frame per batch, not one per rank message: the collector's receive thread then
# pays per node and tick, not per rank message.
# A relay also decodes its ranks' plain steps messages (no collectives, no refused record)
# and sends them as columns (StepColumns): payloads[i] == b"" stands for the next row of
# `cols.rows`, so every rank message keeps its place in the batch and a rank's messages
# are ingested in the order it sent them. The collector validates the columns as strictly
# as a message (judge/ingest_columns.py): the relay saves node 0 the per-message decode and
# Python work, and is trusted with nothing (it holds a rank's key, and any rank may send
# the same rows itself).
RELAY_TAG = b"traceml-relay/1"
RELAY_ROUTE = struct.Struct(">I")
MAX_RELAY_BATCH = 4_096  # payloads per relay message
MAX_RELAY_ROUTE = (1 << 32) - 1
# A batch may be this large: any one valid rank message fits, with the batch's envelope.
MAX_RELAY_BATCH_BYTES = MAX_MESSAGE_BYTES + (64 << 10)


MAX_COLUMN_GROUPS = 64  # phase lists in one batch's columns (ranks send one each)


class StepGroup(Struct, array_like=True, forbid_unknown_fields=True):
    """The records of a batch's rows that share one phase list, as little-endian packed
    arrays, rows in batch order and each row's records in its order: step (int64), t_end,
    step_ms (float64) and the phase values (float64, len(phases) per record; NaN: None).
    Lengths and values are checked on receipt (judge/ingest_columns.py)."""

    phases: Annotated[list[Short], Meta(min_length=1, max_length=MAX_PHASES)]
    step: bytes
    t_end: bytes
    step_ms: bytes
    values: bytes


class StepRow(Struct, array_like=True, forbid_unknown_fields=True):
    """One rank's steps message without its records: its envelope, which group holds its
    `n` records, and its `dropped` and `forced` (None: none forced) as the rank sent them."""

    id: Identity
    seq: Count
    t: Epoch
    group: Annotated[int, Meta(ge=0, lt=MAX_COLUMN_GROUPS)]
    n: Annotated[int, Meta(ge=0, le=MAX_RECORDS_PER_BATCH)]
    dropped: Count = 0
    forced: list[Count] | None = None


class StepColumns(Struct, array_like=True, forbid_unknown_fields=True):
    groups: Annotated[list[StepGroup], Meta(max_length=MAX_COLUMN_GROUPS)]
    rows: Annotated[list[StepRow], Meta(max_length=MAX_RELAY_BATCH)]


# What a relayed heartbeat or sys sample's payload is in its batch (it travels in
# RelayBatch.beats or .samples): 0xc1 is never used in msgpack, so no rank message is
# either (a relay forwards no payload that is one of them).
BEAT_MARK = b"\xc1h"
SYS_MARK = b"\xc1s"
RELAY_MARKS = (BEAT_MARK, SYS_MARK)


# A relay's own counters: 2**40 batches is 35 years at a thousand a second; a count above
# it is a forged one (lost_batches read 4.6e18 once, from a key holder's batch).
MAX_RELAY_COUNT = 1 << 40
RelayCount = Annotated[int, Meta(ge=0, le=MAX_RELAY_COUNT)]


class RelayBatch(Struct, array_like=True, forbid_unknown_fields=True, omit_defaults=True):
    """omit_defaults: a batch without columns is the same bytes as before columns."""

    node: Annotated[int, Meta(ge=0, le=MAX_WORLD_SIZE)]
    batches: RelayCount  # relay messages sent before this one: a gap is a lost batch
    dropped: RelayCount  # rank messages the relay could not forward (its queues were full)
    routes: Annotated[list[Annotated[int, Meta(ge=0, le=MAX_RELAY_ROUTE)]],
                      Meta(max_length=MAX_RELAY_BATCH)]
    payloads: Annotated[list[bytes], Meta(max_length=MAX_RELAY_BATCH)]
    # The rows that empty payloads stand for, in order (absent from an older relay).
    cols: StepColumns | None = None
    # Heartbeats and sys samples, each decoded and checked by its own Struct as part of
    # the batch (one decode for all): BEAT_MARK and SYS_MARK payloads stand for the next
    # of each, in order. The relay sends each as its rank's bytes (msgspec.Raw).
    beats: Annotated[list[Heartbeat], Meta(max_length=MAX_RELAY_BATCH)] | None = None
    samples: Annotated[list[Sys], Meta(max_length=MAX_RELAY_BATCH)] | None = None


_RELAY_DECODER = msgspec.msgpack.Decoder(RelayBatch)


def encode_relay_batch(batch: RelayBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode_relay_batch(data: bytes) -> RelayBatch:
    """A relay's batch, or ProtocolError (its payloads are not decoded here)."""
    if len(data) > MAX_RELAY_BATCH_BYTES:
        raise ProtocolError("relay batch too large")
    try:
        batch = _RELAY_DECODER.decode(data)
    except Exception as exc:
        raise ProtocolError(f"bad relay batch: {exc}"[:200]) from None
    if len(batch.routes) != len(batch.payloads):
        raise ProtocolError("a relay batch needs one route per payload")
    rows = 0 if batch.cols is None else len(batch.cols.rows)
    if batch.payloads.count(b"") != rows:
        raise ProtocolError("a relay batch needs one column row per empty payload")
    if (batch.payloads.count(BEAT_MARK) != len(batch.beats or ())
            or batch.payloads.count(SYS_MARK) != len(batch.samples or ())):
        raise ProtocolError("a relay batch needs one heartbeat or sample per mark")
    return batch


def decode_plain_steps(payload: bytes, max_records: int
                       ) -> tuple[Steps, tuple[str, ...]] | None:
    """For a node relay: a steps message that decode() would give whole (every record
    kept), without collectives and with at most `max_records` records, and its checked
    phase names; None for anything else. Cheaper than decode() (no StepRecord objects): a
    relay checks every steps message of its node."""
    if len(payload) > MAX_MESSAGE_BYTES:
        return None
    try:
        wire = _DECODER.decode(payload)  # the union: its kind is required, as decode's
        if not isinstance(wire, Steps):
            return None
        phases = _phases(wire.phases)
    except Exception:  # not a valid message: decode() will say so
        return None
    ident, n = wire.id, len(phases)
    if (wire.v != PROTOCOL_VERSION or ident.rank >= ident.world_size or wire.colls
            or len(wire.records) > max_records
            or (wire.forced is not None and len(wire.forced) != n)):
        return None
    for rec in wire.records:
        if not _record_ok(rec, n):
            return None
    return wire, phases


def relayed_mark(payload: bytes) -> bytes | None:
    """For a node relay: BEAT_MARK or SYS_MARK where `payload` is a heartbeat or sys
    sample that decode() takes whole (so its bytes decode in the batch's typed list, and
    one bad message never costs its batch), None for anything else (sent as it came)."""
    try:
        wire = decode_wire(payload)
    except ProtocolError:
        return None
    if isinstance(wire, Heartbeat):
        return BEAT_MARK
    return SYS_MARK if isinstance(wire, Sys) else None


def relayed_ok(wire: Heartbeat | Sys) -> bool:
    """A relayed heartbeat or sample's checks beyond its Struct's (decode_wire's)."""
    return wire.v == PROTOCOL_VERSION and wire.id.rank < wire.id.world_size


def column_phases(group: StepGroup) -> tuple[str, ...]:
    """A column group's phase names, checked as a steps message's are (ProtocolError)."""
    return _phases(group.phases)


# --- stacks of a node's stuck ranks, taken by its launcher (docs/hangs.md) ------------------
# A rank stuck in native code holding the GIL sends nothing, not even its own stack; only
# its ancestor may ptrace it (Yama). So the collector asks the rank's node relay, on the
# route kept for the relay itself, and the relay asks its launcher over a private pipe:
#   collector -> relay: [RELAY_TAG, RELAY_SELF_ROUTE, RelayStackRequest]
#   relay -> launcher -> relay: RelayStackRequest, then RelayStacks (a socketpair)
#   relay -> collector: [RELAY_STACKS_TAG, RelayStacks]
# The collector takes a RelayStacks only from the connection that relays that very rank's
# messages, for the pid that rank is now, and only when it asked: a rank's key opens the
# ingest socket but cannot make it the relay of another rank.
RELAY_STACKS_TAG = b"traceml-relay-stacks/1"
RELAY_SELF_ROUTE = MAX_RELAY_ROUTE  # never a rank's route (relay.py skips it)
RELAY_STACK_MAX = 16_000  # characters of one dump (as requests.NATIVE_STACK_MAX)
MAX_RELAY_STACKS_BYTES = RELAY_STACK_MAX * 4 + 1024  # UTF-8, with the envelope


class RelayStackRequest(Struct, tag="relay_stack_request", forbid_unknown_fields=True):
    rank: Annotated[int, Meta(ge=0, lt=MAX_WORLD_SIZE)]
    pid: Annotated[int, Meta(ge=1, le=1 << 31)]


class RelayStacks(Struct, tag="relay_stacks", forbid_unknown_fields=True):
    """One rank's threads as `py-spy dump --native` printed them, from its node."""

    node: Annotated[int, Meta(ge=0, le=MAX_WORLD_SIZE)]
    rank: Annotated[int, Meta(ge=0, lt=MAX_WORLD_SIZE)]
    pid: Annotated[int, Meta(ge=1, le=1 << 31)]
    text: Annotated[str, Meta(max_length=RELAY_STACK_MAX)]

    def __post_init__(self) -> None:
        force_setattr(self, "text", clean_text(self.text))  # before memory, disk or screen


_RELAY_STACKS_DECODER = msgspec.msgpack.Decoder(RelayStackRequest | RelayStacks)


def encode_relay_stacks(msg: RelayStackRequest | RelayStacks) -> bytes:
    return _ENCODER.encode(msg)


def decode_relay_stacks(data: bytes) -> RelayStackRequest | RelayStacks:
    """A stack request or a node's stack, validated; ProtocolError otherwise."""
    if len(data) > MAX_RELAY_STACKS_BYTES:
        raise ProtocolError("relay stacks message too large")
    try:
        return _RELAY_STACKS_DECODER.decode(data)
    except Exception as exc:
        raise ProtocolError(f"not a relay stacks message: {exc}"[:200]) from None
