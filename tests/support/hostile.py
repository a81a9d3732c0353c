"""Hostile traffic for the collector fuzz tests, and the accounting of what it must do.

Every item is the list of ZeroMQ frames one DEALER send produces plus what the collector
must make of it: "malformed" (decode rejects it, or it is not one frame), "foreign"
(a valid message of another run: another world size) or "valid" (a message of the
fuzzed run, from one of its ranks, counted in "messages"). Hypothesis strategies draw
the hostile material; a seeded `random.Random` multiplies a drawn pool into the ~100,000
messages a real collector is fed, which hypothesis alone could not draw in seconds.
Labels given by construction ("this version is 2") are checked against `decode` in
process before anything is sent, so a message that should be rejected but is not
fails the test instead of skewing the counts.
"""

from __future__ import annotations

import functools
import math
import random
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from traceml_agent import protocol
from traceml_agent.findings import CHECKS
from traceml_agent.protocol import PHASES, Identity, ProtocolError, decode
from traceml_agent.sanitize import clean_line

WORLD = 4
IDENTS = tuple(Identity(r, r, 0, "fuzz-host", 50_000 + r, WORLD) for r in range(WORLD))
T0 = 1_700_000_000.0
MALFORMED, FOREIGN, VALID = "malformed", "foreign", "valid"

Frames = list[bytes]


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def template(kind: str, ident: Identity = IDENTS[0], seq: int = 1) -> dict[str, Any]:
    """A valid message of each kind as a plain map, shaped as agent/transport.py sends it."""
    msg: dict[str, Any] = {"v": protocol.PROTOCOL_VERSION, "kind": kind, "id": ident.to_wire(),
                           "seq": seq, "t": T0}
    if kind == "hello":
        msg.update(run="fuzz", device="cpu", backend="gloo", env={"MASTER_ADDR": "127.0.0.1"})
    elif kind == "steps":
        msg.update(phases=list(PHASES), dropped=0,
                   records=[[3, T0, 100.0, 5.0, None, 30.0, 50.0, 4.0, 8.0, 3.0]])
    elif kind == "sys":
        msg.update(cpu_pct=101.5, rss_mb=3512.0, gpu_util=None, gpu_mem_mb=None,
                   gpu_mem_total_mb=None)
    elif kind == "heartbeat":
        msg.update(step=3, phase="forward", in_phase_s=0.01, collectives=12,
                   in_collective=None, since_step_s=0.2)
    elif kind == "stacks":
        msg.update(stacks=[["MainThread", '  File "train.py", line 3, in <module>\n']])
    elif kind == "goodbye":
        msg.update(exit_code=0, error=None, steps=3)
    elif kind == "checks":
        msg.update(findings=[{"id": "no-distributed-sampler", "severity": "critical",
                              "ranks": [0], "evidence": "every rank reads all 64 samples",
                              "fix": "use a DistributedSampler"}],
                   facts={"param_checksum": 1.5, "device": None, "batch_size": 16})
    elif kind == "capture":
        msg.update(capture_id=1, state="done", steps=0, path="/run/traces/capture1-rank0.json",
                   error=None)
    return msg


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every place in a message a value can be swapped: each map value and list item."""
    out = [prefix] if prefix else []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(
        obj, list) else ()
    for key, value in items:
        out += _paths(value, (*prefix, key))
    return out


KINDS = sorted(protocol.KINDS)
PATHS = [(kind, path) for kind in KINDS for path in _paths(template(kind))]
DELETE = object()  # a substitution that removes the key instead


def substitute(kind: str, path: tuple, value: Any) -> dict[str, Any]:
    msg = template(kind)
    node = msg
    for key in path[:-1]:
        node = node[key]
    if value is DELETE and isinstance(node, dict):
        del node[path[-1]]
    elif value is DELETE:
        node.pop(path[-1])
    else:
        node[path[-1]] = value
    return msg


# --- hypothesis strategies ---------------------------------------------------------------

EXTREMES = [
    None, True, False, 0, -1, 1 << 62, (1 << 62) + 1, (1 << 63) - 1, -(1 << 63),
    (1 << 64) - 1, 0.0, -0.0, 5e-324, 1e-300, 1e308, -1e308, math.nan, -math.nan, math.inf,
    -math.inf, "", "x" * 257, "y" * 70_000, "\u0000", "\U0001f525" * 100, [], {}, [None] * 30,
    msgpack.ExtType(5, b"x"), msgpack.ExtType(127, b"\x00" * 12), msgpack.Timestamp(int(T0)),
    b"", b"bytes",
]
SCALARS = (st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1)
           | st.floats() | st.text(max_size=40) | st.binary(max_size=16)
           | st.sampled_from(EXTREMES))
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(
        st.text(max_size=8) | st.integers(-3, 3), inner, max_size=4),
    max_leaves=16,
)


@st.composite
def substituted(draw: st.DrawFn) -> bytes:
    """A valid message with one value swapped for anything msgpack can carry, or removed,
    or an unknown field added."""
    kind, path = draw(st.sampled_from(PATHS))
    value = draw(VALUES | st.just(DELETE))
    if draw(st.integers(0, 9)) == 0:
        msg = template(kind)
        msg[draw(st.text(max_size=10))] = value if value is not DELETE else 1
    else:
        msg = substitute(kind, path, value)
    return pack(msg)


@st.composite
def mangled(draw: st.DrawFn) -> bytes:
    """A valid message's bytes, truncated, with bytes flipped, inserted or deleted."""
    kind = draw(st.sampled_from(KINDS))
    raw = bytearray(pack(template(kind)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["cut", "flip", "insert", "delete"]))
        at = draw(st.integers(0, max(0, len(raw) - 1)))
        if op == "cut":
            del raw[at:]
        elif op == "flip" and raw:
            raw[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "insert":
            raw[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif raw:
            del raw[at]
    return bytes(raw)


HOSTILE_PAYLOADS = st.binary(max_size=300) | substituted() | mangled()


def _bounded_float(hi: float) -> st.SearchStrategy[float]:
    return st.sampled_from([0.0, 5e-324, hi]) | st.floats(0.0, hi)


def _name(limit: int) -> st.SearchStrategy[str]:
    return st.sampled_from(list(PHASES)) | st.text(max_size=limit)


@st.composite
def valid_messages(draw: st.DrawFn) -> bytes:
    """A message decode accepts, with values drawn up to every bound: other runs' world
    sizes, restarted pids, custom phase names past the run's limit, huge step numbers."""
    world = draw(st.sampled_from([WORLD, WORLD, WORLD, 1, protocol.MAX_WORLD_SIZE]))
    ident = Identity(draw(st.integers(0, world - 1)), draw(st.integers(0, 8)),
                     draw(st.integers(0, protocol.MAX_WORLD_SIZE)), draw(st.text(max_size=256)),
                     draw(st.sampled_from([1, 2, 1 << 31])), world)
    kind = draw(st.sampled_from(KINDS))
    big = st.integers(0, 1 << 62)
    opt = st.none() | _bounded_float(1e9)
    body: dict[str, Any] = {}
    if kind == "steps":
        # Unique as the collector sees them: control characters are cleaned on receipt,
        # so "\x08" and "\x1f" are the same name there (and a repeat is refused).
        names = draw(st.lists(_name(64), min_size=1, max_size=protocol.MAX_PHASES,
                              unique_by=clean_line))
        record = st.tuples(big | st.integers(0, 50), _bounded_float(1e11),
                           _bounded_float(protocol.MAX_STEP_MS),
                           st.lists(st.none() | _bounded_float(protocol.MAX_STEP_MS),
                                    min_size=len(names), max_size=len(names)))
        records = [[s, t, ms, *ph] for s, t, ms, ph in draw(st.lists(record, max_size=20))]
        body = {"phases": names, "records": records, "dropped": draw(big)}
    elif kind == "hello":
        body = {"run": draw(st.text(max_size=256)), "device": draw(st.text(max_size=64)),
                "env": draw(st.dictionaries(st.text(max_size=256), st.text(max_size=1024),
                                            max_size=protocol.MAX_ENV_ENTRIES))}
    elif kind == "sys":
        body = {k: draw(opt) for k in ("rss_mb", "gpu_mem_mb", "gpu_mem_total_mb")}
        body["cpu_pct"] = draw(st.none() | _bounded_float(1e5))
        body["gpu_util"] = draw(st.none() | _bounded_float(100.0))
        for name in ("power_w", "sm_clock_mhz", "sm_clock_max_mhz"):  # GPU health (NVML)
            body[name] = draw(st.none() | _bounded_float(1e5))
        body["throttle"] = draw(st.none() | st.lists(
            st.sampled_from(typing.get_args(protocol.ThrottleReason)), max_size=16))
        body["gpu_note"] = draw(st.none() | st.text(max_size=protocol.MAX_STR))
    elif kind == "heartbeat":
        body = {"step": draw(big), "phase": draw(st.none() | _name(64)),
                "in_phase_s": draw(opt), "collectives": draw(big),
                "in_collective": draw(st.none() | _name(64)), "since_step_s": draw(opt),
                "parallel": draw(st.sampled_from([None, "ddp", "fsdp"]))}
    elif kind == "checks":
        finding = st.builds(lambda check, sev, ranks, ev, fix: {
            "id": check, "severity": sev, "ranks": ranks, "evidence": ev, "fix": fix},
            st.sampled_from(sorted(CHECKS)), st.sampled_from(["info", "warning", "critical"]),
            st.lists(st.integers(0, WORLD - 1), max_size=WORLD, unique=True),
            st.text(min_size=1, max_size=200), st.text(min_size=1, max_size=200))
        facts = st.none() | st.fixed_dictionaries({
            "param_checksum": st.none() | st.floats(allow_nan=False, allow_infinity=False),
            "device": st.none() | st.text(max_size=128),
            "batch_size": st.none() | st.integers(1, 1 << 24)})
        body = {"findings": draw(st.lists(finding, max_size=protocol.MAX_FINDINGS)),
                "facts": draw(facts)}
    elif kind == "capture":
        body = {"capture_id": draw(big), "state": draw(st.sampled_from(
                    sorted(protocol.CAPTURE_STATES))), "steps": draw(st.integers(0, 1 << 20)),
                "path": draw(st.none() | st.text(max_size=protocol.MAX_PATH)),
                "error": draw(st.none() | st.text(max_size=protocol.MAX_ERROR_CHARS))}
    elif kind == "stacks":
        body = {"stacks": draw(st.lists(st.tuples(st.text(max_size=128), st.text(
            max_size=protocol.MAX_STACK_CHARS)).map(list), max_size=protocol.MAX_THREADS))}
    else:
        body = {"exit_code": draw(st.none() | st.integers(-(1 << 31), 1 << 31)),
                "error": draw(st.none() | st.text(max_size=protocol.MAX_ERROR_CHARS)),
                "steps": draw(big)}
    payload = protocol.encode(kind, ident, draw(big), draw(_bounded_float(1e11)), **body)
    decode(payload)  # the strategy's own promise: raises if it drew an invalid message
    return payload


def draw_pool(strategy: st.SearchStrategy, n: int) -> list[Any]:
    """Up to n values of a strategy, the same ones on every run (derandomized), drawn
    through hypothesis's own engine rather than `.example()`."""
    pool: list[Any] = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(strategy)
    def grab(value: Any) -> None:
        pool.append(value)

    grab()
    return pool


# --- what the collector must make of a payload -------------------------------------------

def classify(frames: Frames) -> str | None:
    """What the collector must count for one send, per its documented rules; None for a
    decodable message of the fuzzed run, which the fuzz must not send (it would stand in
    for one of the run's ranks and change the record it checks)."""
    if len(frames) != 1:
        return MALFORMED  # the ROUTER adds the peer's frame: anything but 2 is malformed
    try:
        msg = decode(frames[0])
    except ProtocolError:
        return MALFORMED
    return FOREIGN if msg.ident.world_size != WORLD else None


def _must_reject(payload: bytes) -> bytes:
    try:
        msg = decode(payload)
    except ProtocolError:
        return payload
    raise AssertionError(f"decode accepted a message built to be invalid: {msg!r:.300}")


def deep_nesting(depth: int, opener: bytes = b"\x91") -> bytes:
    """An array (or map) nested `depth` deep: msgpack.packb could not even build it."""
    return opener * depth + b"\xc0"


def known_bad(rng: random.Random) -> bytes:
    """One message invalid by construction: each kind of hostility the brief names."""
    kind = rng.choice(KINDS)
    case = rng.randrange(14)
    if case == 0:
        version = protocol.PROTOCOL_VERSION
        return pack(substitute(kind, ("v",), rng.choice([0, version - 1, version + 1, -1,
                                                         (1 << 64) - 1, str(version),
                                                         float(version), True, None])))
    if case == 1:
        return pack(substitute(kind, ("kind",), rng.choice(
            ["", "shutdown", "HELLO", "steps\x00", 7, None, ["hello"], {"k": 1}])))
    if case == 2:  # a rank outside the world it claims
        return pack(substitute(kind, ("id", "rank"), rng.choice(
            [WORLD, WORLD + 1, 1 << 20, (1 << 64) - 1, -1, -(1 << 63)])))
    if case == 3:
        path = rng.choice([("t",), ("id", "world_size"), ("seq",), ("id", "pid")])
        return pack(substitute(kind, path, rng.choice([math.nan, math.inf, -math.inf, -1,
                                                       (1 << 64) - 1, 1e300, True, "1"])))
    if case == 4:  # a step record holding what no number field takes: the whole message
        # (NaN, infinities, negatives and over-a-day numbers cost only their record: the
        # valid ranks' stream sends those, see Ranks._records)
        slot = rng.randrange(10)
        value = rng.choice([True, False, "5", [1.0], {"ms": 1.0}, b"\x01"])
        return pack(substitute("steps", ("records", 0, slot), value))
    if case == 5:  # extension types and timestamps anywhere
        path = rng.choice(_paths(template(kind)))
        return pack(substitute(kind, path, rng.choice(
            [msgpack.ExtType(rng.randrange(128), rng.randbytes(rng.randrange(17))),
             msgpack.Timestamp(rng.randrange(1 << 33))])))
    if case == 6:
        return deep_nesting(_rarely(rng, 1_100, 100_000),
                            rng.choice([b"\x91", b"\xdc\x00\x01", b"\x81\xa1k"]))
    if case == 7:  # lengths that promise gigabytes
        head = rng.choice([b"\xdd", b"\xdb", b"\xdf", b"\xc6"])
        return head + b"\xff\xff\xff\xff" + rng.randbytes(rng.randrange(32))
    if case == 8:  # strings over their limits, up to past msgpack's own cap
        path = rng.choice([("id", "host"), ("run",), ("device",)])
        return pack(substitute("hello", path, "h" * _rarely(rng, 257, 40_000)))
    if case == 9:
        return pack({**template("steps"), "phases": [f"p{i}" for i in range(25)], "records": []})
    if case == 10:  # big ones, built once: sending thousands would only cost time
        return rng.choice(_big()) if rng.random() < 0.01 else pack(
            substitute(kind, ("seq",), 1 << 63))
    if case == 11:  # bool where a number belongs
        path = rng.choice([("seq",), ("t",), ("id", "rank"), ("id", "world_size")])
        return pack(substitute(kind, path, rng.choice([True, False])))
    if case == 12:  # raw bytes (bin) where a string belongs
        return pack(substitute("hello", ("id", "host"), rng.randbytes(rng.randrange(1, 9))))
    return pack(template(kind)) + rng.randbytes(rng.randrange(1, 5))  # trailing bytes


def _rarely(rng: random.Random, common: int, heavy: int) -> int:
    """Mostly the cheap size, sometimes the heavy one: the fuzz stays a few seconds long."""
    return heavy if rng.random() < 0.01 else common


@functools.cache
def _big() -> tuple[bytes, ...]:
    """A batch one record over the limit, and a batch whose records are all valid but
    whose bytes exceed the message size limit."""
    over = [[i, T0, 1.0, 1.0] for i in range(protocol.MAX_RECORDS_PER_BATCH + 1)]
    records = [[i, T0 + i, 100.0, *[12.5] * len(PHASES)]
               for i in range(protocol.MAX_RECORDS_PER_BATCH)]
    huge = pack({**template("steps"), "records": records})
    assert len(huge) > protocol.MAX_MESSAGE_BYTES
    return pack({**template("steps"), "phases": ["x"], "records": over}), huge


def foreign(rng: random.Random) -> bytes:
    """A valid message of another run (another world size): counted, never ingested."""
    world = rng.choice([1, 2, 3, 5, 8, 64, protocol.MAX_WORLD_SIZE])
    ident = Identity(rng.randrange(world), 0, 0, "elsewhere", rng.randrange(1 << 31), world)
    return pack(template(rng.choice(KINDS), ident))


# --- the run's own ranks: a valid stream, replays and out-of-order batches -------------

@dataclass
class Expected:
    """What the collector's record must say once everything was sent, by the rules
    documented in RunState.ingest: a record whose step is not above the rank's last
    one is a duplicate (replayed or out of order), counted but not recorded; a record the
    decoder refuses (a negative phase) is counted as bad each time it arrives."""

    counts: dict[str, int] = field(default_factory=lambda: {MALFORMED: 0, FOREIGN: 0, VALID: 0})
    records: int = 0
    duplicates: int = 0
    steps: list[int] = field(default_factory=lambda: [0] * WORLD)
    last_step: list[int] = field(default_factory=lambda: [-1] * WORLD)
    dropped: list[int] = field(default_factory=lambda: [0] * WORLD)
    bad_records: list[int] = field(default_factory=lambda: [0] * WORLD)

    def steps_batch(self, rank: int, steps: list[int], dropped: int, bad: int = 0) -> None:
        self.bad_records[rank] += bad
        for step in steps:
            if step <= self.last_step[rank]:
                self.duplicates += 1
            else:
                self.records += 1
                self.steps[rank] += 1
                self.last_step[rank] = step
        self.dropped[rank] = max(self.dropped[rank], dropped)


# A steps message as sent: its bytes, the steps of its valid records, the agent's dropped
# count, and how many of its records the decoder must refuse.
Batch = tuple[bytes, list[int], int, int]


class Ranks:
    """The fuzzed run's four ranks, encoding with protocol.encode as agents do."""

    def __init__(self, rng: random.Random, expected: Expected) -> None:
        self.rng = rng
        self.exp = expected
        self.seq = [0] * WORLD
        self.next_step = [0] * WORLD
        self.dropped = [0] * WORLD
        self.sent: list[list[Batch]] = [[] for _ in range(WORLD)]
        self.held: list[Batch | None] = [None] * WORLD

    def _encode(self, rank: int, kind: str, **body: Any) -> bytes:
        self.seq[rank] += 1
        return protocol.encode(kind, IDENTS[rank], self.seq[rank], T0 + self.seq[rank] / 10,
                               **body)

    def hello(self, rank: int) -> bytes:
        return self._encode(rank, "hello", run="fuzz", device="cpu", backend="gloo",
                            env={f"K{i}": "v" * 1024 for i in range(protocol.MAX_ENV_ENTRIES)})

    def _records(self, steps: list[int]) -> tuple[list[list], list[int]]:
        """The records of these steps, and the steps whose records are valid: now and then
        one carries a negative phase (a cross-stream pair of an older agent) and is refused
        by the decoder alone."""
        rng = self.rng
        out, kept = [], []
        for s in steps:
            phases = [rng.choice([None, 0.0, rng.uniform(0, 50), protocol.MAX_STEP_MS])
                      if rng.random() < 0.05 else rng.uniform(0.5, 40.0) for _ in PHASES]
            step_ms = rng.choice([0.0, protocol.MAX_STEP_MS]) if rng.random() < 0.01 else (
                sum(v or 0.0 for v in phases))
            if rng.random() < 0.01:
                phases[rng.randrange(len(phases))] = -rng.uniform(0.001, 5.0)
            else:
                kept.append(s)
            out.append([s, T0 + s * 0.1, min(step_ms, protocol.MAX_STEP_MS), *phases])
        return out, kept

    def _batch(self, rank: int, steps: list[int]) -> Batch:
        if self.rng.random() < 0.02:
            self.dropped[rank] += self.rng.randrange(1, 50)
        records, kept = self._records(steps)
        payload = self._encode(rank, "steps", phases=list(PHASES), records=records,
                               dropped=self.dropped[rank])
        return payload, kept, self.dropped[rank], len(steps) - len(kept)

    def _emit(self, rank: int, batch: Batch) -> Frames:
        payload, steps, dropped, bad = batch
        self.exp.steps_batch(rank, steps, dropped, bad)
        self.sent[rank].append(batch)
        return [payload]

    def next(self) -> Frames:
        """One valid message of a random rank; the expected record follows it."""
        rng, rank = self.rng, self.rng.randrange(WORLD)
        self.exp.counts[VALID] += 1
        roll = rng.random()
        if self.held[rank] is not None and roll < 0.3:  # the batch held back arrives late
            batch, self.held[rank] = self.held[rank], None
            return self._emit(rank, batch)
        if roll < 0.70:
            n = rng.randrange(1, 9)
            start = self.next_step[rank]
            if rng.random() < 0.05:  # overlaps steps already sent: part is a duplicate
                start = max(0, start - rng.randrange(1, 6))
            steps = list(range(start, start + n))
            self.next_step[rank] = max(self.next_step[rank], start + n)
            batch = self._batch(rank, steps)
            if self.held[rank] is None and rng.random() < 0.05:  # hold it: out of order
                self.held[rank] = batch
                batch = self._batch(rank, list(range(self.next_step[rank],
                                                      self.next_step[rank] + n)))
                self.next_step[rank] += n
            return self._emit(rank, batch)
        if roll < 0.76 and self.sent[rank]:  # the very same bytes again
            return self._emit(rank, rng.choice(self.sent[rank]))
        if roll < 0.88:
            return [self._encode(rank, "sys", cpu_pct=rng.choice([None, 0.0, 1e5]),
                                 rss_mb=rng.uniform(0, 1e9), gpu_util=rng.choice([None, 100.0]),
                                 gpu_mem_mb=None, gpu_mem_total_mb=1e9)]
        if roll < 0.99:
            return [self._encode(rank, "heartbeat", step=rng.choice([0, 1 << 62]),
                                 phase=rng.choice([None, "forward", "p" * 64]),
                                 in_phase_s=rng.choice([None, 0.0, 1e9]),
                                 collectives=rng.choice([0, 1 << 62]), in_collective=None,
                                 since_step_s=rng.choice([None, 0.0, 0.5]))]
        threads = [[f"t{i}", "s" * protocol.MAX_STACK_CHARS] for i in range(protocol.MAX_THREADS)]
        return [self._encode(rank, "stacks", stacks=threads)]


def traffic(n_hostile: int, n_valid: int, seed: int, pool: list[bytes]
            ) -> tuple[list[Frames], Expected]:
    """Hello from every rank, then n_hostile hostile sends interleaved with n_valid valid
    ones (replays and late batches included), and the record they must leave."""
    rng = random.Random(seed)
    exp = Expected()
    ranks = Ranks(rng, exp)
    items: list[Frames] = []
    for r in range(WORLD):
        exp.counts[VALID] += 1
        items.append([ranks.hello(r)])
    hostile = _hostile(rng, pool, exp)
    p_valid = n_valid / (n_valid + n_hostile)
    sent_valid = sent_hostile = 0
    while sent_valid < n_valid or sent_hostile < n_hostile:
        if sent_hostile >= n_hostile or (sent_valid < n_valid and rng.random() < p_valid):
            items.append(ranks.next())
            sent_valid += 1
        else:
            items.append(next(hostile))
            sent_hostile += 1
    for r in range(WORLD):  # a batch still held back is sent last
        if ranks.held[r] is not None:
            exp.counts[VALID] += 1
            items.append(ranks._emit(r, ranks.held[r]))
    return items, exp


def _hostile(rng: random.Random, pool: list[bytes], exp: Expected) -> Iterator[Frames]:
    """Endless hostile sends: the drawn pool, re-mangled; built-to-fail messages; other
    runs' messages; multi-frame sends. Anything that turns out to be a valid message of
    this run is skipped (see `classify`)."""
    while True:
        roll = rng.random()
        if roll < 0.55:
            frames = [_remangle(rng, rng.choice(pool))]
        elif roll < 0.80:
            frames = [_must_reject(known_bad(rng))]
        elif roll < 0.92:
            frames = [foreign(rng)]
        else:
            frames = [rng.choice(pool) if rng.random() < 0.5 else pack(template(rng.choice(KINDS)))
                      for _ in range(rng.choice([0, 2, 2, 3, 7]))] or [b"", b""]
        label = classify(frames)
        if label is None:
            continue
        exp.counts[label] += 1
        yield frames


def _remangle(rng: random.Random, payload: bytes) -> bytes:
    """A pool item as drawn, or cut short or with a byte changed: cheap variety."""
    roll = rng.random()
    if roll < 0.5 or not payload:
        return payload
    if roll < 0.75:
        return payload[: rng.randrange(len(payload))]
    b = bytearray(payload)
    b[rng.randrange(len(b))] = rng.randrange(256)
    return bytes(b)

