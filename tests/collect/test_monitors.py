"""Socket monitors on addresses of their own (collect/descriptors.py `monitor_socket`).

A fresh-clone run failed building a second Collector in one test process: pyzmq names a
monitor's inproc address after the socket's descriptor, the kernel hands the descriptor
out again once the first socket closes, and the new monitor's bind failed with "Address
already in use" while the old endpoint was being released. The same happens to a relay
that restarts its sockets, or to the soak's thousands of relays in one process."""

from __future__ import annotations

import zmq

from traceml_tui.collect.descriptors import FAILED, monitor_socket


def _reuse(monitor) -> int:
    """Sockets made, monitored and closed one after the other, 200 times, in one
    context: how many monitors failed to start."""
    ctx = zmq.Context()
    failed = 0
    try:
        for _ in range(200):
            sock = ctx.socket(zmq.ROUTER)
            try:
                mon = monitor(sock)
            except zmq.ZMQError:
                failed += 1
            else:
                mon.close(linger=0)
            sock.close(linger=0)
    finally:
        ctx.term()
    return failed


def test_a_monitor_starts_whatever_descriptor_its_socket_reuses():
    assert _reuse(lambda s: monitor_socket(s, FAILED)) == 0


def test_the_default_address_is_what_failed():
    """The near miss, kept as the reason: pyzmq's own address collides on reuse."""
    assert _reuse(lambda s: s.get_monitor_socket(FAILED)) > 0


def test_the_monitor_still_reports_its_sockets_events():
    ctx = zmq.Context()
    try:
        server = ctx.socket(zmq.ROUTER)
        mon = monitor_socket(server, zmq.EVENT_LISTENING)
        server.bind("tcp://127.0.0.1:*")
        assert mon.poll(5000), "no event from the monitor"
        from zmq.utils.monitor import recv_monitor_message

        assert recv_monitor_message(mon)["event"] == zmq.EVENT_LISTENING
        mon.close(linger=0)
        server.close(linger=0)
    finally:
        ctx.term()
