"""The wire protocol: every kind round-trips, and every malformed or hostile payload is
rejected with ProtocolError (never another exception, never reaching the collector)."""

from __future__ import annotations

import inspect
import math
import re

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from traceml_agent import protocol
from traceml_agent.protocol import (
    MAX_ENV_ENTRIES,
    MAX_ERROR_CHARS,
    MAX_MESSAGE_BYTES,
    MAX_PHASES,
    MAX_RECORDS_PER_BATCH,
    MAX_STR,
    MAX_WORLD_SIZE,
    PHASES,
    PROTOCOL_VERSION,
    Identity,
    Message,
    ProtocolError,
    StepRecord,
    decode,
    encode,
)

IDENT = Identity(rank=1, local_rank=1, node=0, host="node-a", pid=4242, world_size=4)
T = 1_700_000_000.25
# One record per PHASES order: dataloader, h2d, forward, backward, sync, optimizer, wait.
RECORD = [7, T, 100.0, 5.0, None, 30.0, 50.0, 4.0, 8.0, 3.0]


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def raw(kind: str = "heartbeat", ident: dict | None = None, **fields) -> dict:
    """A valid message as a plain map; fields override or add keys."""
    msg = {"v": PROTOCOL_VERSION, "kind": kind, "id": ident or IDENT.to_wire(), "seq": 3, "t": T}
    if kind == "steps":
        msg.update(phases=list(PHASES), records=[list(RECORD)], dropped=0)
    if kind == "stacks":
        msg.update(stacks=[["MainThread", "  File \"train.py\", line 3, in <module>\n"]])
    if kind == "capture":
        msg.update(capture_id=1, state="done", steps=0, path="/run/traces/capture1-rank0.json",
                   error=None)
    msg.update(fields)
    return msg


def payload(msg: Message) -> dict:
    """The fields of a message's decoded Struct without the envelope, by name."""
    body = msg.body
    return {name: getattr(body, name) for name in body.__struct_fields__
            if name not in ("v", "id", "seq", "t")}


def with_id(**fields) -> dict:
    return raw(ident={**IDENT.to_wire(), **fields})


def without(mapping: dict, key: str) -> dict:
    return {k: v for k, v in mapping.items() if k != key}


def record(pos: int, value) -> dict:
    """A steps message whose single record holds `value` at index `pos`
    (0 step, 1 t_end, 2 step_ms, 3.. phase_ms)."""
    rec = list(RECORD)
    rec[pos] = value
    return raw("steps", records=[rec])


# --- round trips ---------------------------------------------------------------------------

ROUND_TRIPS = [
    ("hello", {"run": "demo", "device": "cuda:1", "backend": "nccl",
               "env": {"MASTER_ADDR": "10.0.0.1", "NCCL_DEBUG": "WARN"}, "auto": False,
               "attempt": 2, "key": "0123456789abcdef0123456789abcdef"}),
    ("sys", {"at_exit": True, "cpu_pct": 312.5, "thread_cpu_pct": 80.5, "cpu_wait_pct": 12.5,
             "stepping_pct": 92.5, "rss_mb": 2048.0,
             "gpu_util": 97.0,
             "gpu_mem_mb": None, "gpu_mem_total_mb": 81920.0, "gpu_alloc_mb": 30_500.0,
             "gpu_reserved_mb": None,
             "gpu_peak_mb": 41_000.5, "device": "cuda:3", "power_w": 412.5,
             "sm_clock_mhz": 1410.0, "sm_clock_max_mhz": 1980.0, "temp_c": 83.0,
             "throttle": ("power cap", "sw thermal"),
             "gpu_uuid": "MIG-9d6a7c2e-55f3-5b1c-9a5e-2f0d6c9b1e11", "gpu_note": None,
             "mem_avail_mb": 12_288.5}),
    ("heartbeat", {"step": 17, "phase": "forward", "in_phase_s": 0.25, "collectives": 40,
                   "in_collective": "all_reduce", "groups": {"world": 39, "1": 1},
                   "in_group": "1", "grad_bytes": 4_194_304, "since_step_s": 12.5,
                   "parallel": "fsdp",
                   "framework": "PyTorch Lightning",
                   "agent_off": "internal error: RuntimeError('boom')",
                   "replays": 1200, "batches": 31, "timing_faults": 4, "capture_skips": 9,
                   "agent_busy": "deep trace stopping",
                   "device_rule": "current device (parameters on CPU: offload)",
                   "key": "fedcba9876543210fedcba9876543210",
                   "gc_slow": 12, "gc_slow_ms": 480.5, "gc_max_ms": 61.0, "gc_full": 14,
                   "loader_len": 50, "loader_epochs": 3, "loader_workers": 2,
                   "loader_persistent": False, "late_steps": 3}),
    ("stacks", {"stacks": (("MainThread", "  File \"train.py\", line 9, in <module>\n"),
                           ("traceml-sender", "  ...\n"))}),
    ("goodbye", {"exit_code": -11, "error": "Traceback ...\nRuntimeError: boom", "steps": 99}),
]


@pytest.mark.parametrize("kind, body", ROUND_TRIPS, ids=[k for k, _ in ROUND_TRIPS])
def test_round_trip(kind, body):
    wire = {k: [list(x) for x in v] if k == "stacks" else v for k, v in body.items()}
    msg = decode(encode(kind, IDENT, 12, T, **wire))
    assert isinstance(msg, Message)
    assert (msg.kind, msg.ident, msg.seq, msg.t) == (kind, IDENT, 12, T)
    got = payload(msg)
    if kind == "stacks":
        assert type(msg.body) is protocol.Stacks and got.pop("nccl") is None
        got["stacks"] = tuple(got["stacks"])
    assert got == body
    assert type(msg.body).__name__.lower() == kind  # the kind's own Struct, typed
    assert msg.phases == () and msg.records == ()


def test_forced_counts_must_match_the_phases():
    with pytest.raises(ProtocolError):
        decode(pack(raw("steps", forced=[1, 2])))
    with pytest.raises(ProtocolError):
        decode(pack(raw("steps", forced=[-1] * len(PHASES))))
    assert decode(pack(raw("steps"))).forced == (0,) * len(PHASES)


def test_round_trip_steps():
    records = [list(RECORD), [8, T + 0.1, 90.0, None, None, 30.0, 45.0, 0.0, 8.0, 7.0]]
    forced = [0, 0, 3, 0, 0, 0, 0]
    msg = decode(encode("steps", IDENT, 5, T, phases=list(PHASES), records=records, dropped=2,
                        forced=forced))
    assert (msg.kind, msg.ident, msg.seq, msg.t) == ("steps", IDENT, 5, T)
    assert msg.phases == PHASES
    assert (msg.body.dropped, msg.forced) == (2, tuple(forced))
    assert msg.records == (
        StepRecord(7, T, 100.0, (5.0, None, 30.0, 50.0, 4.0, 8.0, 3.0)),
        StepRecord(8, T + 0.1, 90.0, (None, None, 30.0, 45.0, 0.0, 8.0, 7.0)),
    )


def test_defaults_for_optional_body_fields():
    assert payload(decode(encode("hello", IDENT, 0, T))) == {
        "run": "", "device": "cpu", "backend": "", "env": {}, "auto": True, "attempt": None,
        "key": None}
    assert payload(decode(encode("goodbye", IDENT, 0, T))) == {
        "exit_code": None, "error": None, "steps": 0}
    assert decode(encode("steps", IDENT, 0, T, phases=["x"], records=[])).records == ()


def test_an_older_agents_heartbeat_decodes_with_the_new_fields_at_their_defaults():
    """The CUDA progress and timing fields are optional: a heartbeat without them (an agent
    of this protocol version from before them) is not refused."""
    body = decode(pack(raw(step=5, since_step_s=0.5))).body
    assert (body.replays, body.batches, body.timing_faults, body.capture_skips) == (0, 0, 0, 0)
    assert body.agent_busy is None and body.device_rule is None


def test_limits_are_inclusive():
    msg = decode(pack(raw("hello", run="r" * MAX_STR, env={f"k{i}": "v" for i in range(64)})))
    assert len(msg.body.env) == MAX_ENV_ENTRIES
    last = with_id(rank=MAX_WORLD_SIZE - 1, world_size=MAX_WORLD_SIZE)
    assert decode(pack(last)).ident.rank == MAX_WORLD_SIZE - 1
    names = [f"p{i}" for i in range(MAX_PHASES)]
    rec = [0, T, 1.0] + [0.0] * MAX_PHASES
    assert decode(pack(raw("steps", phases=names, records=[rec]))).phases == tuple(names)


# --- rejection -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(protocol.KINDS))
def test_templates_are_valid(kind):
    """Each rejection case below changes one thing in one of these valid messages."""
    assert decode(pack(raw(kind))).kind == kind
    assert decode(pack(record(0, 8))).records[0].step == 8

BAD = {
    # not bytes, not msgpack, or not one msgpack value
    "str-payload": "a string",
    "none-payload": None,
    "list-payload": [b"x"],
    "empty": b"",
    "reserved-byte": b"\xc1",
    "trailing-bytes": pack(raw()) + b"\x00",
    "truncated-map": pack(raw())[:-1],
    # not a map
    "array": pack([1, "heartbeat"]),
    "int": pack(1),
    "string": pack("hello"),
    "nil": pack(None),
    # version
    "no-version": pack(without(raw(), "v")),
    "version-1": pack(raw(v=1)),  # the protocol before `forced`
    "version-next": pack(raw(v=PROTOCOL_VERSION + 1)),
    "version-0": pack(raw(v=0)),
    "version-str": pack(raw(v="1")),
    # kind
    "no-kind": pack(without(raw(), "kind")),
    "unknown-kind": pack(raw("shutdown")),
    "kind-list": pack(raw(kind=["hello"])),
    # identity
    "no-id": pack(without(raw(), "id")),
    "id-list": pack(raw(id=[1, 1, 0, "h", 1, 4])),
    **{f"id-missing-{f}": pack(raw(ident=without(IDENT.to_wire(), f)))
       for f in ("rank", "local_rank", "node", "host", "pid", "world_size")},
    "rank-str": pack(with_id(rank="1")),
    "rank-float": pack(with_id(rank=1.0)),
    "host-int": pack(with_id(host=7)),
    "host-bytes": pack(with_id(host=b"node-a")),
    "rank-eq-world": pack(with_id(rank=4)),
    "rank-gt-world": pack(with_id(rank=9)),
    "world-0": pack(with_id(rank=0, world_size=0)),
    "world-too-big": pack(with_id(rank=0, world_size=MAX_WORLD_SIZE + 1)),
    # negative numbers
    "rank-neg": pack(with_id(rank=-1)),
    "pid-neg": pack(with_id(pid=-1)),
    "seq-neg": pack(raw(seq=-1)),
    "t-neg": pack(raw(t=-1.0)),
    "dropped-neg": pack(raw("steps", dropped=-1)),
    "cpu-neg": pack(raw("sys", cpu_pct=-1.0)),
    "cpu-wait-over-100": pack(raw("sys", cpu_wait_pct=100.5)),
    "stepping-over-100": pack(raw("sys", stepping_pct=100.5)),
    "stepping-neg": pack(raw("sys", stepping_pct=-0.1)),
    # non-finite
    "t-nan": pack(raw(t=math.nan)),
    "t-inf": pack(raw(t=math.inf)),
    "gpu-util-nan": pack(raw("sys", gpu_util=math.nan)),
    "in-phase-inf": pack(raw(in_phase_s=-math.inf)),
    # records and phases
    "record-map": pack(raw("steps", records=[{"step": 7}])),
    "records-map": pack(raw("steps", records={"0": RECORD})),
    "records-missing": pack(without(raw("steps"), "records")),
    "phases-missing": pack(without(raw("steps"), "phases")),
    "phases-empty": pack(raw("steps", phases=[], records=[])),
    "phases-too-many": pack(raw("steps", phases=[f"p{i}" for i in range(MAX_PHASES + 1)],
                                records=[])),
    "phases-duplicate": pack(raw("steps", phases=["forward", "backward", "forward"],
                                 records=[[0, T, 1.0, 1.0, 1.0, 1.0]])),
    "phase-name-int": pack(raw("steps", phases=["forward", 2], records=[])),
    "too-many-records": pack(raw("steps", phases=["x"],
                                 records=[[i, T, 1.0, 1.0]
                                          for i in range(MAX_RECORDS_PER_BATCH + 1)])),
    # msgpack extension types and non-string keys
    "ext-in-extra-field": pack(raw(extra=msgpack.ExtType(5, b"x"))),
    "ext-as-t": pack(raw(t=msgpack.ExtType(1, b"\x00" * 8))),
    "timestamp-as-t": pack(raw(t=msgpack.Timestamp(1_700_000_000))),
    "int-map-key": pack(raw("hello", env={1: "x"})),
    # bool where a number is expected
    **{f"bool-{f}": pack(with_id(**{f: True}))
       for f in ("rank", "local_rank", "node", "pid", "world_size")},
    "bool-seq": pack(raw(seq=True)),
    "bool-t": pack(raw(t=True)),
    "bool-step": pack(record(0, True)),
    "bool-step-ms": pack(record(2, True)),
    "bool-phase-ms": pack(record(3, False)),
    "bool-dropped": pack(raw("steps", dropped=True)),
    "bool-exit-code": pack(raw("goodbye", exit_code=False)),
    "bool-heartbeat-step": pack(raw(step=True)),
    "exit-code-out-of-range": pack(raw("goodbye", exit_code=1 << 40)),
    # strings over the limits
    "host-long": pack(with_id(host="h" * (MAX_STR + 1))),
    "run-long": pack(raw("hello", run="r" * (MAX_STR + 1))),
    "device-long": pack(raw("hello", device="d" * 65)),
    "env-key-long": pack(raw("hello", env={"k" * (MAX_STR + 1): "v"})),
    "env-value-long": pack(raw("hello", env={"k": "v" * 1025})),
    "env-too-many": pack(raw("hello", env={f"k{i}": "v" for i in range(MAX_ENV_ENTRIES + 1)})),
    "env-not-map": pack(raw("hello", env=["k", "v"])),
    "attempt-negative": pack(raw("hello", attempt=-1)),
    "attempt-huge": pack(raw("hello", attempt=1 << 40)),
    "error-long": pack(raw("goodbye", error="e" * (MAX_ERROR_CHARS + 1))),
    "phase-name-long": pack(raw("steps", phases=["p" * 65], records=[])),
    "heartbeat-phase-long": pack(raw(phase="p" * 65)),
    "heartbeat-agent-off-long": pack(raw(agent_off="x" * 257)),
    "heartbeat-agent-off-int": pack(raw(agent_off=3)),
    "heartbeat-replays-neg": pack(raw(replays=-1)),
    "heartbeat-batches-huge": pack(raw(batches=1 << 63)),
    "heartbeat-faults-float": pack(raw(timing_faults=1.5)),
    "heartbeat-skips-bool": pack(raw(capture_skips=True)),
    "heartbeat-busy-long": pack(raw(agent_busy="x" * (MAX_STR + 1))),
    "heartbeat-device-rule-int": pack(raw(device_rule=3)),
    "giant-extra-string": pack(raw(extra="x" * (MAX_ERROR_CHARS * 4 + 1))),
}


@pytest.mark.parametrize("payload", BAD.values(), ids=BAD.keys())
def test_decode_rejects(payload):
    with pytest.raises(ProtocolError):
        decode(payload)


# A record that breaks a bound is refused alone, and counted: its batch's other records
# (about ten steps) are real and are kept.
BAD_RECORDS = {
    "step-neg": [-1, T, 100.0],
    "step-float": [7.5, T, 100.0],
    "step-ms-neg": [7, T, -0.5],
    "t-end-inf": [7, math.inf, 100.0],
    "step-ms-nan": [7, T, math.nan],
    "step-ms-over-a-day": [7, T, protocol.MAX_STEP_MS * 2],
    "phase-ms-neg": [7, T, 100.0, 5.0, None, 30.0, -0.001],
    "phase-ms-nan": [7, T, 100.0, math.nan],
    "phase-ms-inf": [7, T, 100.0, 5.0, None, 30.0, 50.0, math.inf],
    "record-short": RECORD[:-1],
    "record-long": RECORD + [1.0],
}


def _bad(head: list) -> list:
    """A record whose first fields are `head`, the rest as RECORD's (or `head` whole when
    it is a full record of the wrong length)."""
    return list(head) if len(head) >= len(RECORD) - 1 else [*head, *RECORD[len(head):]]


@pytest.mark.parametrize("head", BAD_RECORDS.values(), ids=BAD_RECORDS.keys())
def test_a_bad_record_is_refused_alone_and_counted(head):
    before = [8, T + 0.1, 90.0, 5.0, None, 30.0, 45.0, 0.0, 8.0, 2.0]
    after = [10, T + 0.3, 90.0, 5.0, None, 30.0, 45.0, 0.0, 8.0, 2.0]
    msg = decode(pack(raw("steps", records=[before, _bad(head), after])))
    assert [r.step for r in msg.records] == [8, 10]
    assert msg.bad_records == 1
    alone = decode(pack(raw("steps", records=[_bad(head)])))
    assert alone.records == () and alone.bad_records == 1


def test_a_negative_cross_stream_phase_costs_one_record_not_the_batch():
    """Ten steps of which one carries a negative phase (a cross-stream event pair from an
    older agent): the other nine reach the collector, the tenth is counted as refused."""
    records = [[s, T + s, 100.0, 5.0, None, 30.0, 50.0, 4.0, 8.0, 3.0] for s in range(10)]
    records[4][5] = -0.25  # backward
    msg = decode(encode("steps", IDENT, 9, T, phases=list(PHASES), records=records))
    assert [r.step for r in msg.records] == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    assert msg.bad_records == 1
    assert decode(pack(raw("steps"))).bad_records == 0


def test_every_truncation_is_rejected():
    payload = encode("steps", IDENT, 1, T, phases=list(PHASES), records=[RECORD] * 3)
    for cut in range(len(payload)):
        with pytest.raises(ProtocolError):
            decode(payload[:cut])


def test_oversize_payload_rejected_before_parsing():
    n = MAX_MESSAGE_BYTES // 80  # about 80 bytes per record: well over the limit in total
    records = [[i, T, 100.0, *([1.5] * len(PHASES))] for i in range(n)]
    big = encode("steps", IDENT, 1, T, phases=list(PHASES), records=records)
    assert len(big) > MAX_MESSAGE_BYTES
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(big)
    half = encode("steps", IDENT, 1, T, phases=list(PHASES), records=records[: n // 2])
    assert len(decode(half).records) == n // 2


@pytest.mark.parametrize("version", [True, float(PROTOCOL_VERSION)], ids=repr)
def test_version_must_be_the_int_version(version):
    with pytest.raises(ProtocolError):
        decode(pack(raw(v=version)))


def test_timestamp_extension_rejected_anywhere():
    with pytest.raises(ProtocolError):
        decode(pack(raw(extra=msgpack.Timestamp(1_700_000_000))))


# --- properties ----------------------------------------------------------------------------


FUZZ = settings(max_examples=500, deadline=None, database=None)
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats()
    | st.text(max_size=20) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12,
)
FIELDS = ["v", "kind", "id", "seq", "t", "phases", "records", "dropped", "env", "exit_code",
          "error", "step", "phase", "cpu_pct"]


def message_or_protocol_error(payload) -> bool:
    try:
        return isinstance(decode(payload), Message)
    except ProtocolError:
        return True  # any other exception propagates and fails the test


@FUZZ
@given(st.binary(max_size=512))
def test_arbitrary_bytes_give_message_or_protocol_error(payload):
    assert message_or_protocol_error(payload)


@FUZZ
@given(kind=st.sampled_from(sorted(protocol.KINDS)), key=st.sampled_from(FIELDS), value=VALUES)
def test_structured_garbage_gives_message_or_protocol_error(kind, key, value):
    msg = raw(kind)
    msg[key] = value
    assert message_or_protocol_error(pack(msg))


def test_module_never_uses_pickle():
    src = inspect.getsource(protocol)
    imports = [ln for ln in src.splitlines() if re.match(r"\s*(import|from)\s", ln)]
    assert imports and not [ln for ln in imports if re.search("pickle|marshal|dill|shelve", ln)]
    assert "pickle." not in src


@pytest.mark.parametrize("fields", [
    {"state": "exploded"}, {"capture_id": -1}, {"path": "x" * 5000}, {"steps": "4"},
    {"extra": 1},
])
def test_bad_capture_events_are_rejected(fields):
    with pytest.raises(ProtocolError):
        decode(pack(raw("capture", **fields)))


def test_capture_requests_round_trip_and_reject_anything_else():
    assert protocol.decode_capture_request(protocol.encode_capture_request(7, 5)) == (7, 5)
    for bad in (b"", b"\xc1", msgpack.packb({"op": "capture", "id": 1}),
                msgpack.packb({"op": "shutdown", "id": 1, "steps": 1}),
                msgpack.packb({"op": "capture", "id": 1, "steps": 0})):
        with pytest.raises(ProtocolError):
            protocol.decode_capture_request(bad)


def test_a_body_field_cannot_replace_the_envelope():
    with pytest.raises(ValueError, match="envelope"):
        protocol.encode("capture", IDENT, 1, T, id=3)


INJECTIONS = [
    ("title", "\x1b]0;pwned\x07"),
    ("clear screen", "\x1b[2J"),
    ("C1 CSI", "\x9b2J"),
    ("DEL and NUL", "a\x7fb\x00c"),
]


@pytest.mark.parametrize("name, evil", INJECTIONS, ids=[i[0] for i in INJECTIONS])
def test_remote_text_reaches_nobody_as_terminal_control(name, evil):
    """Issue 20 finding 7: host names, errors, stacks and phase names arrive cleaned."""
    ident = Identity(0, 0, 0, f"host{evil}", 1, 2)
    msgs = [
        decode(encode("goodbye", ident, 1, T, exit_code=1, error=f"boom{evil}\nline 2",
                      steps=1)),
        decode(encode("stacks", ident, 1, T, stacks=[[f"t{evil}", f"  File x\n{evil}\n"]])),
        decode(encode("steps", ident, 1, T, phases=[f"ph{evil}"], records=[[0, T, 1.0, 1.0]],
                      dropped=0)),
        decode(encode("heartbeat", ident, 1, T, agent_busy=f"busy{evil}",
                      device_rule=f"rule{evil}")),
    ]
    texts = [msgs[0].ident.host, msgs[0].body.error, *msgs[1].body.stacks[0],
             msgs[2].phases[0], msgs[3].body.agent_busy, msgs[3].body.device_rule]
    for text in texts:
        assert not any(ord(c) < 0x20 and c not in "\n\t" or 0x7F <= ord(c) < 0xA0
                       for c in text), repr(text)
    assert msgs[0].body.error.endswith("\nline 2")  # a traceback keeps its lines
    assert "\n" not in msgs[0].ident.host
