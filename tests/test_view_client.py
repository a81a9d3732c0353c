"""A viewer never wedges: every request it makes returns within its timeout, answered or
not, whatever state its socket is in (view/client.py)."""

from __future__ import annotations

import socket
import threading
import time

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


