"""The launcher lets its store thread leave torch's TCPStore client before it exits: a
daemon thread still inside that C++ call when the interpreter finalizes aborts the
process (SIGABRT, exit -6), after a job that succeeded (a loaded machine: node 1's
launcher ended while node 0's store was already gone)."""

from __future__ import annotations

import socket
import threading
import time

from traceml_agent import handover
from traceml_tui.launch.launcher import HANDOVER_EXIT_WAIT_S, let_handover_end


def test_the_store_thread_has_left_its_store_call_when_the_launcher_returns():
    gone = socket.socket()  # node 0's store, gone: its port refuses, the client retries
    gone.bind(("127.0.0.1", 0))
    port = gone.getsockname()[1]
    gone.close()
    ended = threading.Event()
    thread = threading.Thread(target=handover.prove_shared, daemon=True,
                              args=("127.0.0.1", port, "ab" * 32, 1, ended.is_set))
    thread.start()
    time.sleep(0.5)  # inside its first connect (a refused one is retried for ~12 s)
    ended.set()  # torchrun has ended
    started = time.monotonic()
    let_handover_end(thread)
    assert not thread.is_alive()
    assert time.monotonic() - started < HANDOVER_EXIT_WAIT_S


def test_no_store_thread_is_nothing_to_wait_for():
    let_handover_end(None)
