"""Control and view requests are Structs the decoder validates (agent/requests.py): a
request outside its vocabulary or bounds is answered with one line and changes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import pytest

from traceml_agent.requests import (
    CaptureStart,
    Finish,
    RequestError,
    ViewRequest,
    decode_control,
    decode_view,
    encode_control,
)
from traceml_tui.collect.collector import Collector
from traceml_tui.judge.state import RunState
from traceml_tui.runfolder.layout import RunFolder


class Rep:
    """Stands in for a collector's REP socket: one request, the replies it got."""

    def __init__(self, request: bytes) -> None:
        self.request, self.replies = request, []

    def recv(self) -> bytes:
        return self.request

    def send(self, data: bytes) -> None:
        self.replies.append(json.loads(data))

    def send_json(self, obj: object) -> None:
        self.replies.append(obj)

    def close(self) -> None:
        pass


def control(coll: Collector, request: bytes) -> dict | None:
    """The collector's one reply to `request`; None for an accepted finish (answered
    once the record is written)."""
    real, coll.control = coll.control, Rep(request)
    try:
        coll.handle_control()
        replies = coll.control.replies
        assert len(replies) <= 1
        return replies[0] if replies else None
    finally:
        coll.control = real


@pytest.fixture
def coll(tmp_path: Path):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    c = Collector(run_dir, RunState("run", world_size=2))
    try:
        yield c
    finally:
        c.close()


def test_a_finish_with_an_absurd_end_time_is_refused_and_the_record_still_ends(coll):
    """An end time no clock gives (1e300, or NaN) once passed the hand validator, and the
    summary's date then raised out of the serve loop: no record at all."""
    for bad in (b'{"op": "finish", "ended_at": 1e300}',
                b'{"op": "finish", "ended_at": NaN}',
                b'{"op": "finish", "grace_s": 1e999}',
                b'{"op": "finish", "root_cause": [1, 2, 3]}',
                b'{"op": "finish", "extra": {' + b", ".join(
                    b'"k%d": 0' % i for i in range(100)) + b"}}"):
        reply = control(coll, bad)
        assert reply["ok"] is False and reply["error"].startswith("bad request"), reply
        assert coll.finishing is None, bad
    assert control(coll, b'{"op": "ping"}') == {"ok": True, "ranks": 0}
    assert control(coll, encode_control(Finish(torchrun_exit=0, ended_at=1.7e9,
                                               grace_s=0.0))) is None
    assert coll.finishing is not None
    reply = coll.write_record(coll.finishing[0])
    assert reply["ok"] and RunFolder(coll.run_dir).summary_json.exists()


def test_control_and_view_requests_round_trip_and_refuse_what_is_not_theirs():
    finish = Finish(torchrun_exit=1, root_cause=(3, -9), command=["python", "t.py"],
                    ended_at=1.7e9, extra={"run_dir": "/r"}, exit_code=130, key="k" * 64)
    assert decode_control(encode_control(finish)) == finish
    for bad in (b"[", b'{"op": "stop"}', b'{"op": "finish", "torchrun_exit": "0"}',
                b'{"op": "finish", "interrupted": 1}', b'{"op": "ping", "x": 1}',
                b'{"op": "finish", "command": [1]}', b"{}" + b" " * (2 << 20)):
        with pytest.raises(RequestError):
            decode_control(bad)
    assert decode_view(msgpack.packb({"op": "view", "rank": 3})) == ViewRequest(rank=3)
    assert decode_view(msgpack.packb({"op": "capture"})) == CaptureStart(ranks=None, steps=5)
    for bad in ({"op": "view", "rank": -1}, {"op": "view", "rank": True},
                {"op": "capture", "steps": 0}, {"op": "capture", "ranks": list(range(65))},
                {"op": "capture", "ranks": [1, "x"]}, {"op": "summary", "more": 1}, [1]):
        with pytest.raises(RequestError):
            decode_view(msgpack.packb(bad))
