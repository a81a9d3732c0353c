"""A viewer never wedges: every request it makes returns within its timeout, answered or
not, whatever state its socket is in (view/client.py)."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import zmq

from traceml_tui.view.client import ViewClient, ViewUnavailable


class NoPipeClient(ViewClient):
    """A client whose socket has no pipe to its peer until a connection completes
    (ZMQ_IMMEDIATE), and the address has no listener: its send has nowhere to go, the
    state a REQ socket is left in when its connection to the collector is torn down."""

    def _socket(self) -> zmq.Socket:
        if self.sock is None:
            sock = super()._socket()
            sock.close(0)
            self.sock = self.ctx.socket(zmq.REQ)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.IMMEDIATE, 1)
            self.sock.setsockopt(zmq.SNDTIMEO, sock_timeout(self))
            self.sock.connect(self.address)
        return self.sock


def sock_timeout(client: ViewClient) -> int:
    """The send timeout the product's own socket carries (-1: none, blocks forever)."""
    probe = ViewClient(client.address, timeout_s=client.timeout_ms / 1000)
    try:
        return probe._socket().getsockopt(zmq.SNDTIMEO)
    finally:
        probe.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_request_whose_send_cannot_leave_returns_within_its_timeout():
    client = NoPipeClient(f"tcp://127.0.0.1:{free_port()}", timeout_s=0.5)
    outcome: list[BaseException] = []

    def ask() -> None:
        try:
            client.fetch()
        except BaseException as exc:  # noqa: BLE001 - what the request ended with
            outcome.append(exc)

    start = time.monotonic()
    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    asker.join(10)
    assert not asker.is_alive(), "the viewer's request blocked past its timeout"
    assert len(outcome) == 1 and isinstance(outcome[0], ViewUnavailable), outcome
    assert "no answer from the collector" in str(outcome[0])
    assert time.monotonic() - start < 5
    client.close()


def test_the_viewers_socket_sends_with_its_timeout():
    client = ViewClient(f"tcp://127.0.0.1:{free_port()}", timeout_s=1.5)
    try:
        assert client._socket().getsockopt(zmq.SNDTIMEO) == 1500
    finally:
        client.close()




# --- whatever answers at a viewer's address: nothing it says reaches a terminal raw --------
# (issue 42, 7a: a fake collector wrote an OSC 52 clipboard write and screen clears)

_OSC52 = "\x1b]52;c;cm0gLXJmIH4K\x07"
_CLEAR = "\x1b[2J\x1b[3J\x9b2J"
_EVIL = f"{_OSC52}{_CLEAR}\u202e\u2028\u200b"


def _hostile_view():
    from traceml_tui.viewmodel import (
        VIEW_PHASES,
        DeepTraceView,
        RankDetail,
        RankRow,
        RunView,
    )

    phases = tuple(1.0 for _ in VIEW_PHASES)
    row = RankRow(0, 0, f"host{_EVIL}", 10, 5.0, phases, 1.0, 1.0, None, None, 0.1,
                  f"ok{_EVIL}")
    detail = RankDetail(0, f"h{_EVIL}", 5.0, 5.0, phases, phases, (5.0,), "ok",
                        f"err{_EVIL}", stack=f"line1\n{_EVIL}", gpu=_EVIL, notes=(_EVIL,),
                        memory=(_EVIL,))
    capture = DeepTraceView(1, 5, (0,), {f"0{_EVIL}": _EVIL}, {"0": _EVIL}, {"0": _EVIL},
                            {"0": _EVIL}, text=f"analysis\n{_EVIL}", saved=_EVIL)
    view = RunView(f"run{_EVIL}", 1, 1, 1.0, 10, 1.0, f"LABEL{_EVIL}", 0, f"fwd{_EVIL}",
                   "info", f"summary{_EVIL}", 1.0, (row,), 5.0, phases, detail, f"cpu{_EVIL}",
                   checks=((_EVIL, "warn", (0,), _EVIL, _EVIL),), capture=capture,
                   node_rows=((1, row),), episodes=((0.0, None, _EVIL, _EVIL),),
                   failure=_EVIL, collectives=((_EVIL, _EVIL, _EVIL, 1.0, None, 1.0, None),))
    return view, detail


def _strings(value, out: list[str]) -> list[str]:
    """Every string inside a decoded reply (struct fields, sequences, mapping keys)."""
    import msgspec

    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, msgspec.Struct):
        for name in value.__struct_fields__:
            _strings(getattr(value, name), out)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _strings(v, out)
    elif isinstance(value, dict):
        for k, v in value.items():
            _strings(k, out)
            _strings(v, out)
    return out


def _unsafe(strings: list[str]) -> list[str]:
    import unicodedata

    return [s for s in strings
            if any(c not in "\n\t" and unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")
                   for c in s)]


def _fake_collector(answers: list[list[bytes]]) -> tuple[str, threading.Thread]:
    """A REP socket that answers each request with the next of `answers`: not a collector."""
    ctx = zmq.Context.instance()
    rep = ctx.socket(zmq.REP)
    rep.setsockopt(zmq.LINGER, 0)
    port = rep.bind_to_random_port("tcp://127.0.0.1")

    def serve() -> None:
        try:
            for frames in answers:
                if not rep.poll(10_000):
                    return
                rep.recv_multipart()
                rep.send_multipart(frames)
        finally:
            rep.close(0)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"tcp://127.0.0.1:{port}", thread


def test_nothing_a_fake_collector_says_reaches_the_terminal_raw():
    import msgpack
    import msgspec

    from traceml_agent.requests import CaptureReply, ErrorReply
    from traceml_tui.viewmodel import encode_detail, encode_view

    view, detail = _hostile_view()
    # A summary the model accepts (its unknown keys ignored), its strings hostile.
    summary = json.loads((Path(__file__).parents[1] / "data" / "rich_summary.json").read_text())
    summary["run"]["name"] = _EVIL
    summary["run"][_EVIL] = [_EVIL, {"stack": f"a\n{_EVIL}"}]
    summary["diagnosis"]["summary"] = f"a\n{_EVIL}"
    summary["ranks"][0]["host"] = _EVIL
    summary["hang"]["stacks"]["2"][0]["stack"] = f"frame\n{_EVIL}"
    enc = msgspec.msgpack.encode
    address, server = _fake_collector([
        [encode_view(view), encode_detail(detail)],
        [msgpack.packb(summary)],
        [enc(CaptureReply(False, error=_EVIL))],
        [enc(ErrorReply(error=_EVIL))],
        [msgpack.packb({"error": _EVIL})],
    ])
    client = ViewClient(address, timeout_s=5)
    try:
        got_view, got_detail = client.fetch(pinned=0)
        assert got_view.rows[0].host.startswith("host") and got_view.rows[0].steps == 10
        assert got_detail is not None and got_detail.stack.startswith("line1\n")
        got_summary = client.summary()
        reply = client.capture()
        errors = []
        for ask in (client.fetch, client.summary):
            try:
                ask()
            except ViewUnavailable as exc:
                errors.append(str(exc))
    finally:
        client.close()
        server.join(10)
    seen = _strings([got_view, got_detail, got_summary, reply, errors], [])
    assert len(errors) == 2 and len(seen) > 40
    assert "]52;c;cm0gLXJmIH4K" in got_summary.ranks[0].host  # typed, and cleaned
    assert not _unsafe(seen), _unsafe(seen)[:3]
    assert not [s for s in seen if "\x1b" in s or "\x9b" in s]  # OSC 52, clears: defused
