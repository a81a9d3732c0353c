"""The wire protocol between the per-rank agents and the collector.

This is the only module that knows how messages look on the wire. Both sides
import it: the agent to encode, the collector to decode and validate. Messages
are msgpack maps (never pickle: a collector must be safe to expose to a socket)
and every field is checked on receipt, so a malformed or hostile message is
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
             `forced`: per phase, how many times it was closed for lack of an end hook
  sys        a system sample: CPU %, RSS, GPU utilisation and memory, and the CUDA
             device once the agent has learned it
  heartbeat  liveness and progress, from a thread that does not need training: step,
             phase, collectives launched, seconds since the last step, and the training
             framework seen in the process (for the hint when a phase cannot be timed)
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

import math
from dataclasses import dataclass, field
from typing import Any

import msgpack

from . import vocab
from .sanitize import clean_line, clean_text

# 2: steps carry `forced` (phases closed for lack of an end hook), hello `auto`,
# heartbeat `framework`: what the collector needs to say when timing is incomplete.
# heartbeat `agent_off` (optional): why the agent turned its timing off; its step count
# stops for that reason, not because the rank is stuck.
PROTOCOL_VERSION = 2

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
# One step longer than a day is not a measurement, it is corruption.
MAX_STEP_MS = 86_400_000.0


class ProtocolError(ValueError):
    """A message that does not follow this protocol. The collector counts and drops it."""


@dataclass(frozen=True, slots=True)
class Identity:
    rank: int
    local_rank: int
    node: int
    host: str
    pid: int
    world_size: int

    def to_wire(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "node": self.node,
            "host": self.host,
            "pid": self.pid,
            "world_size": self.world_size,
        }


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One optimizer step of one rank. ``phase_ms`` aligns with the batch's phase names;
    None means the phase was not measured on this step (never a made-up 0)."""

    step: int
    t_end: float
    step_ms: float
    phase_ms: tuple[float | None, ...]


@dataclass(frozen=True, slots=True)
class Message:
    kind: str
    ident: Identity
    seq: int
    t: float
    body: dict[str, Any] = field(default_factory=dict)
    # Only for kind == "steps": validated records and their phase names.
    phases: tuple[str, ...] = ()
    records: tuple[StepRecord, ...] = ()


_ENVELOPE = frozenset({"v", "kind", "id", "seq", "t"})

# --- encoding (agent side) -------------------------------------------------------------


def encode(kind: str, ident: Identity, seq: int, t: float, **body: Any) -> bytes:
    """Encode one message. The caller passes plain ints, floats, strings, lists and dicts."""
    if not _ENVELOPE.isdisjoint(body):  # a body field must never replace the envelope's
        raise ValueError(f"body fields {sorted(_ENVELOPE & body.keys())} are envelope names")
    msg = {"v": PROTOCOL_VERSION, "kind": kind, "id": ident.to_wire(), "seq": seq, "t": t}
    msg.update(body)
    return msgpack.packb(msg, use_bin_type=True)


# --- decoding and validation (collector side) ------------------------------------------


def _reject_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not allowed")


def decode(payload: bytes) -> Message:
    """Decode and validate one message, or raise ProtocolError. Never raises anything else."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise ProtocolError("payload is not bytes")
    if len(payload) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(payload)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        raw = msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=True,
            ext_hook=_reject_ext,
            max_str_len=MAX_ERROR_CHARS * 4,
            max_bin_len=0,
            max_array_len=MAX_RECORDS_PER_BATCH,
            max_map_len=MAX_ENV_ENTRIES * 2,
        )
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises many types for bad input
        raise ProtocolError(f"not valid msgpack: {type(exc).__name__}") from None
    try:
        return _validate(raw)
    except ProtocolError:
        raise
    except Exception as exc:  # a shape we did not anticipate is still just a bad message
        raise ProtocolError(f"invalid message: {type(exc).__name__}: {exc}") from None


def _validate(raw: Any) -> Message:
    if not isinstance(raw, dict):
        raise ProtocolError("message is not a map")
    version = raw.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {version!r:.40}")
    kind = raw.get("kind")
    if kind not in KINDS:
        raise ProtocolError(f"unknown kind {kind!r:.40}")
    unknown = raw.keys() - _FIELDS[kind]
    if unknown:  # every field is checked; new fields come with a new protocol version
        raise ProtocolError(f"unknown fields for {kind}: {sorted(map(str, unknown))[:5]}")
    ident = _identity(raw.get("id"))
    seq = _int(raw.get("seq"), "seq", 0, 1 << 62)
    t = _float(raw.get("t"), "t", 0.0, 1e11)
    if kind == "steps":
        phases = _phases(raw.get("phases"))
        records = _records(raw.get("records"), len(phases))
        dropped = _int(raw.get("dropped", 0), "dropped", 0, 1 << 62)
        forced = _forced(raw.get("forced"), len(phases))
        return Message(kind, ident, seq, t, {"dropped": dropped, "forced": forced}, phases,
                       records)
    return Message(kind, ident, seq, t, _BODY_VALIDATORS[kind](raw))


def _int(value: Any, name: str, lo: int, hi: int) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise ProtocolError(f"{name} must be an int in [{lo}, {hi}], got {value!r:.40}")
    return value


def _float(value: Any, name: str, lo: float, hi: float) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or not lo <= value <= hi:
        raise ProtocolError(f"{name} must be a finite number in [{lo}, {hi}], got {value!r:.40}")
    return float(value)


def _opt_float(value: Any, name: str, lo: float, hi: float) -> float | None:
    return None if value is None else _float(value, name, lo, hi)


def _bool(value: Any, name: str) -> bool:
    if type(value) is not bool:
        raise ProtocolError(f"{name} must be true or false")
    return value


def _str(value: Any, name: str, limit: int = MAX_STR, lines: bool = False) -> str:
    """A bounded string, cleaned of control characters (sanitize.py); `lines` keeps
    newlines and tabs (stacks, tracebacks)."""
    if not isinstance(value, str) or len(value) > limit:
        raise ProtocolError(f"{name} must be a string of at most {limit} characters")
    return clean_text(value) if lines else clean_line(value)


def _identity(raw: Any) -> Identity:
    if not isinstance(raw, dict):
        raise ProtocolError("id must be a map")
    world = _int(raw.get("world_size"), "id.world_size", 1, MAX_WORLD_SIZE)
    return Identity(
        rank=_int(raw.get("rank"), "id.rank", 0, world - 1),
        local_rank=_int(raw.get("local_rank"), "id.local_rank", 0, MAX_WORLD_SIZE),
        node=_int(raw.get("node"), "id.node", 0, MAX_WORLD_SIZE),
        host=_str(raw.get("host"), "id.host"),
        pid=_int(raw.get("pid"), "id.pid", 0, 1 << 31),
        world_size=world,
    )


def _phases(raw: Any) -> tuple[str, ...]:
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_PHASES:
        raise ProtocolError(f"phases must be a list of 1..{MAX_PHASES} names")
    names = tuple(_str(p, "phase name", 64) for p in raw)
    if len(set(names)) != len(names):
        raise ProtocolError("phase names repeat")
    return names


def _forced(raw: Any, n_phases: int) -> tuple[int, ...]:
    if raw is None:
        return (0,) * n_phases
    if not isinstance(raw, list) or len(raw) != n_phases:
        raise ProtocolError("forced must be a list with one count per phase")
    return tuple(_int(v, "forced", 0, 1 << 62) for v in raw)


def _records(raw: Any, n_phases: int) -> tuple[StepRecord, ...]:
    if not isinstance(raw, list):
        raise ProtocolError("records must be a list")
    out = []
    for rec in raw:
        if not isinstance(rec, list) or len(rec) != 3 + n_phases:
            raise ProtocolError("a record must be [step, t_end, step_ms, *phase_ms]")
        values = tuple(_opt_float(v, "phase_ms", 0.0, MAX_STEP_MS) for v in rec[3:])
        out.append(
            StepRecord(
                step=_int(rec[0], "step", 0, 1 << 62),
                t_end=_float(rec[1], "t_end", 0.0, 1e11),
                step_ms=_float(rec[2], "step_ms", 0.0, MAX_STEP_MS),
                phase_ms=values,
            )
        )
    return tuple(out)


def _hello(raw: dict) -> dict[str, Any]:
    env = raw.get("env", {})
    if not isinstance(env, dict) or len(env) > MAX_ENV_ENTRIES:
        raise ProtocolError("env must be a map of at most 64 entries")
    return {
        "run": _str(raw.get("run", ""), "run"),
        "device": _str(raw.get("device", "cpu"), "device", 64),
        "backend": _str(raw.get("backend", ""), "backend", 64),
        "auto": _bool(raw.get("auto", True), "auto"),
        "env": {_str(k, "env key"): _str(v, "env value", 1024) for k, v in env.items()},
    }


def _sys(raw: dict) -> dict[str, Any]:
    return {
        "cpu_pct": _opt_float(raw.get("cpu_pct"), "cpu_pct", 0.0, 1e5),
        "rss_mb": _opt_float(raw.get("rss_mb"), "rss_mb", 0.0, 1e9),
        "gpu_util": _opt_float(raw.get("gpu_util"), "gpu_util", 0.0, 100.0),
        "gpu_mem_mb": _opt_float(raw.get("gpu_mem_mb"), "gpu_mem_mb", 0.0, 1e9),
        "gpu_mem_total_mb": _opt_float(raw.get("gpu_mem_total_mb"), "gpu_mem_total_mb", 0.0, 1e9),
        # This process's own figures from torch's caching allocator (sysmetrics.py).
        **{name: _opt_float(raw.get(name), name, 0.0, 1e9)
           for name in ("gpu_alloc_mb", "gpu_reserved_mb", "gpu_peak_mb")},
        # The CUDA device the rank was found to train on (it is learned after hello).
        "device": None if raw.get("device") is None else _str(raw["device"], "device", 64),
    }


MAX_GROUPS = 33  # the agent's 32 named process groups and "other" (hooks.py)


def _groups(raw: Any) -> dict[str, int]:
    if not isinstance(raw, dict) or len(raw) > MAX_GROUPS:
        raise ProtocolError(f"groups must be a map of at most {MAX_GROUPS} group counts")
    return {_str(k, "group", 64): _int(v, "group count", 0, 1 << 62) for k, v in raw.items()}


def _heartbeat(raw: dict) -> dict[str, Any]:
    phase = raw.get("phase")
    collective = raw.get("in_collective")
    group = raw.get("in_group")
    parallel = raw.get("parallel")
    framework = raw.get("framework")
    agent_off = raw.get("agent_off")
    return {
        "step": _int(raw.get("step", 0), "step", 0, 1 << 62),
        "phase": None if phase is None else _str(phase, "phase", 64),
        "in_phase_s": _opt_float(raw.get("in_phase_s"), "in_phase_s", 0.0, 1e9),
        "collectives": _int(raw.get("collectives", 0), "collectives", 0, 1 << 62),
        "in_collective": None if collective is None else _str(collective, "in_collective", 64),
        # Collectives entered per process group, and the group of the one in progress.
        "groups": _groups(raw.get("groups", {})),
        "in_group": None if group is None else _str(group, "in_group", 64),
        # Gradient bytes DDP all-reduces per step (0: not DDP, or not known yet).
        "grad_bytes": _int(raw.get("grad_bytes", 0), "grad_bytes", 0, 1 << 50),
        "since_step_s": _opt_float(raw.get("since_step_s"), "since_step_s", 0.0, 1e9),
        "parallel": None if parallel is None else _str(parallel, "parallel", 16),
        "framework": None if framework is None else _str(framework, "framework", 64),
        "agent_off": None if agent_off is None else _str(agent_off, "agent_off", MAX_STR),
    }


def _stacks(raw: dict) -> dict[str, Any]:
    stacks = raw.get("stacks")
    if not isinstance(stacks, list) or len(stacks) > MAX_THREADS:
        raise ProtocolError(f"stacks must be a list of at most {MAX_THREADS} [thread, text]")
    out = []
    for item in stacks:
        if not isinstance(item, list) or len(item) != 2:
            raise ProtocolError("a stack must be [thread name, text]")
        out.append((_str(item[0], "thread name", 128),
                    _str(item[1], "stack", MAX_STACK_CHARS, lines=True)))
    body: dict[str, Any] = {"stacks": tuple(out)}
    if "nccl" in raw:
        body["nccl"] = _nccl(raw["nccl"])
    return body


def _nccl(raw: Any) -> dict[str, Any] | None:
    """A rank's last collectives per its own NCCL log (nccl_log.py), or None."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or not set(raw) <= {"op", "op_count", "comm", "done",
                                                     "unused"}:
        raise ProtocolError("nccl must be a map of op, op_count, comm, done, unused")

    def opt(name: str, limit: int) -> str | None:
        v = raw.get(name)
        return None if v is None else _str(v, name, limit)

    def count(name: str) -> int | None:
        v = raw.get(name)
        return None if v is None else _int(v, name, 0, 1 << 62)

    return {"op": opt("op", 64), "op_count": count("op_count"), "comm": opt("comm", 64),
            "done": count("done"), "unused": opt("unused", 2000)}


def _goodbye(raw: dict) -> dict[str, Any]:
    code = raw.get("exit_code")
    error = raw.get("error")
    return {
        "exit_code": None if code is None else _int(code, "exit_code", -(1 << 31), 1 << 31),
        "error": None if error is None else _str(error, "error", MAX_ERROR_CHARS, lines=True),
        "steps": _int(raw.get("steps", 0), "steps", 0, 1 << 62),
    }


_COMMON = {"v", "kind", "id", "seq", "t"}
def _checks(raw: dict) -> dict[str, Any]:
    from .checks import Finding, facts_from_wire

    findings = raw.get("findings", [])
    if not isinstance(findings, list) or len(findings) > MAX_FINDINGS:
        raise ProtocolError(f"findings must be a list of at most {MAX_FINDINGS}")
    facts = raw.get("facts")
    try:
        return {"findings": tuple(Finding.from_wire(f) for f in findings),
                "facts": None if facts is None else facts_from_wire(facts)}
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ProtocolError(f"bad checks: {exc}") from None


def _capture(raw: dict) -> dict[str, Any]:
    state = raw.get("state")
    if state not in CAPTURE_STATES:
        raise ProtocolError(f"capture state must be one of {sorted(CAPTURE_STATES)}")
    path, error = raw.get("path"), raw.get("error")
    return {"capture_id": _int(raw.get("capture_id"), "capture_id", 0, 1 << 62), "state": state,
            "steps": _int(raw.get("steps", 0), "steps", 0, 1 << 20),
            "path": None if path is None else _str(path, "path", MAX_PATH),
            "error": None if error is None else _str(error, "error", MAX_ERROR_CHARS,
                                                     lines=True)}


def encode_capture_request(capture_id: int, steps: int) -> bytes:
    return msgpack.packb({"op": "capture", "id": capture_id, "steps": steps})


def decode_capture_request(data: bytes) -> tuple[int, int]:
    """(capture id, steps) of a request from the collector. Raises ProtocolError."""
    try:
        raw = msgpack.unpackb(data, raw=False, ext_hook=_reject_ext, max_bin_len=0,
                              max_array_len=16, max_map_len=16)
    except Exception as exc:
        raise ProtocolError(f"not msgpack: {exc}") from None
    if not isinstance(raw, dict) or raw.get("op") != "capture" or set(raw) != {"op", "id",
                                                                              "steps"}:
        raise ProtocolError("not a capture request")
    return _int(raw["id"], "id", 0, 1 << 62), _int(raw["steps"], "steps", 1, 1 << 20)


_FIELDS = {
    "hello": _COMMON | {"run", "device", "backend", "env", "auto"},
    "steps": _COMMON | {"phases", "records", "dropped", "forced"},
    "sys": _COMMON | {"cpu_pct", "rss_mb", "gpu_util", "gpu_mem_mb", "gpu_mem_total_mb",
                      "gpu_alloc_mb", "gpu_reserved_mb", "gpu_peak_mb", "device"},
    "heartbeat": _COMMON | {"step", "phase", "in_phase_s", "collectives", "in_collective",
                            "groups", "in_group", "grad_bytes", "since_step_s", "parallel",
                            "framework", "agent_off"},
    "stacks": _COMMON | {"stacks", "nccl"},
    "goodbye": _COMMON | {"exit_code", "error", "steps"},
    "checks": _COMMON | {"findings", "facts"},
    "capture": _COMMON | {"capture_id", "state", "steps", "path", "error"},
}

_BODY_VALIDATORS = {"hello": _hello, "sys": _sys, "heartbeat": _heartbeat, "stacks": _stacks,
                    "goodbye": _goodbye, "checks": _checks, "capture": _capture}
