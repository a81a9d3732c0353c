"""Properties of what a key holder can reach, drawn by Hypothesis rather than listed:
the summary writer and the text summary over any state hostile traffic can build, and
the collector's view and control request handlers over any request a viewer can send.

The decoder and RunState have their own property test in test_fuzz_collector.py; these
take the same hostile messages further, to the files and the terminal."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hostile
from jobs import validate_schema
from traceml_agent.protocol import ProtocolError, decode
from traceml_tui import viewmodel
from traceml_tui.collect import collector as collector_mod
from traceml_tui.collect import view_build
from traceml_tui.judge.state import RunState
from traceml_tui.report import summary
from traceml_tui.runfolder import summary_model as model

# C0 and C1 controls except newline (lines) and tab; DEL too. A terminal acts on these.
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def state_from(payloads: list[bytes]) -> tuple[RunState, float]:
    state = RunState("props", hostile.WORLD, started_at=hostile.T0)
    mono = 0.0
    for payload in payloads:
        mono += 0.1
        try:
            state.ingest(decode(payload), mono)
        except ProtocolError:
            state.intake.count_malformed()
    state.evaluate(hostile.T0 + mono, mono + 60.0)
    return state, mono


@settings(max_examples=150, derandomize=True, deadline=None, database=None)
@given(st.lists(hostile.HOSTILE_PAYLOADS | hostile.valid_messages(), max_size=25),
       st.booleans())
def test_the_summary_of_any_received_traffic_is_valid_strict_and_terminal_safe(payloads,
                                                                                complete):
    state, mono = state_from(payloads)
    snap = state.snapshot(hostile.T0 + mono, mono + 60.0, full=True)
    doc = model.to_doc(summary.build(snap, summary.RunMeta(complete=complete)))
    validate_schema(json.loads(json.dumps(doc, allow_nan=False)))
    text = summary.render_text(doc)
    assert not CONTROL.search(text), repr(CONTROL.search(text))
    view = view_build.build(snap, state.recent_steps)
    viewmodel.decode_view(viewmodel.encode_view(view))


class FakeSocket:
    """Stands in for a REP socket: takes the one reply a request must get."""

    def __init__(self, request: bytes) -> None:
        self.request = request
        self.replies: list[list[bytes]] = []

    def recv(self) -> bytes:
        return self.request

    def send(self, data: bytes) -> None:
        self.replies.append([data])

    def send_multipart(self, frames: list[bytes]) -> None:
        self.replies.append(list(frames))

    def send_json(self, obj: object) -> None:
        self.replies.append([json.dumps(obj).encode()])


REQUEST_VALUES = hostile.VALUES | st.lists(hostile.VALUES, max_size=80)
VIEW_REQUESTS = st.one_of(
    st.binary(max_size=64),
    st.builds(msgpack.packb, hostile.VALUES),
    st.builds(lambda op, extra: msgpack.packb({"op": op, **extra}),
              st.sampled_from(["view", "capture", "summary", "stop", ""]) | hostile.VALUES,
              st.dictionaries(st.sampled_from(["rank", "ranks", "steps", "id"]),
                              REQUEST_VALUES, max_size=3)),
)
CONTROL_REQUESTS = st.one_of(
    st.binary(max_size=64),
    st.builds(lambda op, extra: json.dumps({"op": op, **extra}).encode(),
              st.sampled_from(["ping", "status", "x"]),
              st.dictionaries(st.sampled_from(["grace_s", "exit_code", "command", "extra"]),
                              st.none() | st.integers() | st.text(max_size=5)
                              | st.lists(st.integers(), max_size=3), max_size=3)),
)


@settings(max_examples=200, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(hostile.valid_messages(), max_size=12), st.lists(VIEW_REQUESTS, max_size=6),
       st.lists(CONTROL_REQUESTS, max_size=3))
def test_every_view_and_control_request_gets_one_reply_and_the_collector_lives(
        tmp_path_factory, payloads, view_requests, control_requests):
    run_dir = Path(tmp_path_factory.mktemp("run"))
    state, _ = state_from(payloads)
    coll = collector_mod.Collector(run_dir, state)
    real_view, real_control = coll.views.sock, coll.control
    try:
        for request in view_requests:
            coll.views.sock = FakeSocket(request)
            coll.views.handle()
            assert len(coll.views.sock.replies) == 1
            for frame in coll.views.sock.replies[0]:
                msgpack.unpackb(frame)
        for request in control_requests:  # never "finish": that ends the record, by design
            coll.control = FakeSocket(request)
            coll.handle_control()
            assert len(coll.control.replies) == 1
            json.loads(coll.control.replies[0][0])
    finally:
        coll.views.sock, coll.control = real_view, real_control
        coll.close()
