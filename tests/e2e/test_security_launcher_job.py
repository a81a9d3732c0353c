"""The real job of tests/launch/test_security_launcher.py (its unit tests stay there, so that
the quick loop is the folders without tests/e2e): a squatted collector port stops the run
before it starts, in one line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jobs import EXAMPLES

pytestmark = pytest.mark.e2e


@pytest.mark.e2e
def test_a_squatted_collector_port_stops_the_run_before_it_starts_in_one_line(tmp_path):
    """Another local user on node 0 listens first on the master port + 1 (the collector's
    fixed ingest port on a multi-node run): the run does not start (nothing reaches their
    socket), and the launcher says which ports in one line."""
    import os
    import socket

    from jobs import free_ports

    for _ in range(20):
        port = free_ports(3)
        squat = socket.socket()
        try:
            squat.bind(("0.0.0.0", port + 1))
            break
        except OSError:
            squat.close()
    squat.listen()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "traceml_tui", "run", "--nnodes", "2", "--node-rank", "0",
             "--master-addr", "127.0.0.1", "--master-port", str(port), "--nproc-per-node",
             "1", "--headless", "--out", str(tmp_path), "--run-name", "sq",
             str(EXAMPLES / "ddp_toy.py"), "--", "--steps", "5"],
            capture_output=True, text=True, timeout=60,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        squat.settimeout(0.1)
        with pytest.raises(TimeoutError):
            squat.accept()  # no rank ever connected to the squatter
    finally:
        squat.close()
    assert done.returncode != 0
    assert f"cannot listen on 0.0.0.0 ports {port + 1}/{port + 2}: Address already in use" \
        in done.stderr, done.stderr
