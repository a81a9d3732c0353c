"""Socket monitors on addresses of their own (collect/descriptors.py `monitor_socket`).

A fresh-clone run failed building a second Collector in one test process: pyzmq names a
monitor's inproc address after the socket's descriptor, the kernel hands the descriptor
out again once the first socket closes, and the new monitor's bind failed with "Address
already in use" while the old endpoint was being released. The same happens to a relay
that restarts its sockets, or to the soak's thousands of relays in one process."""

from __future__ import annotations

import threading

import zmq

from traceml_tui.collect.descriptors import FAILED, monitor_socket, stop_monitor


def _term(ctx: zmq.Context) -> None:
    """The context's term, failing the test (not stalling the suite) if it hangs: a run
    of the suite waited on one for 20 minutes, its monitors closed before their sockets."""
    done = threading.Thread(target=ctx.term, daemon=True)
    done.start()
    done.join(30)
    assert not done.is_alive(), "zmq context term() hung"


def _monitored(monitor, n: int = 200) -> tuple[int, list[tuple[int, bytes]]]:
    """Sockets made, monitored and closed one after the other, `n` times, in one context:
    how many monitors failed to start, and each started one's (descriptor, address)."""
    ctx = zmq.Context()
    failed, started = 0, []
    try:
        for _ in range(n):
            sock = ctx.socket(zmq.ROUTER)
            try:
                mon = monitor(sock)
            except zmq.ZMQError:
                failed += 1
            else:
                started.append((sock.FD, mon.getsockopt(zmq.LAST_ENDPOINT)))
                stop_monitor(sock, mon)
            sock.close(linger=0)
    finally:
        _term(ctx)
    return failed, started


def test_a_monitor_starts_whatever_descriptor_its_socket_reuses():
    failed, started = _monitored(lambda s: monitor_socket(s, FAILED))
    assert failed == 0 and len(started) == 200


def test_the_default_address_names_the_descriptor_ours_never_repeats():
    """The reason, without waiting for the race: pyzmq's own address is the socket's
    descriptor, so it repeats whenever the kernel hands a descriptor out again (whether
    the old endpoint is still being released then is timing: fresh-clone run 35 met it,
    and a test that demanded the collision failed on run 38 when it did not come). Ours
    never repeats."""
    _, started = _monitored(lambda s: s.get_monitor_socket(FAILED), 50)  # some may collide
    assert started
    for fd, endpoint in started:
        assert endpoint.decode().endswith(f"-{fd}")
    _, ours = _monitored(lambda s: monitor_socket(s, FAILED), 50)
    assert len({endpoint for _, endpoint in ours}) == len(ours) == 50


def test_the_monitor_still_reports_its_sockets_events():
    ctx = zmq.Context()
    try:
        server = ctx.socket(zmq.ROUTER)
        mon = monitor_socket(server, zmq.EVENT_LISTENING)
        server.bind("tcp://127.0.0.1:*")
        assert mon.poll(5000), "no event from the monitor"
        from zmq.utils.monitor import recv_monitor_message

        assert recv_monitor_message(mon)["event"] == zmq.EVENT_LISTENING
        stop_monitor(server, mon)
        server.close(linger=0)
    finally:
        _term(ctx)
