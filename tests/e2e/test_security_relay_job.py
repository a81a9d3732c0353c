"""The real job of tests/collect/test_security_relay.py (its unit tests stay there, so that the
quick loop is the folders without tests/e2e): node 1 started with another secret says so on
its terminal."""

from __future__ import annotations

import json
import subprocess

import pytest
from test_security_relay import SECRET

pytestmark = pytest.mark.e2e


@pytest.mark.e2e
def test_node_1_with_another_secret_says_so_on_its_terminal(tmp_path):
    """Two `traceml run` nodes of one job, node 1 with another TRACEML_SECRET: node 0's
    record misses node 1 (as with a blinded relay, finding 4), and node 1's own terminal now
    says why while the job runs, not only node 0's summary at the end."""
    from jobs import EXAMPLES, free_ports, spawn_traceml

    out, port = tmp_path / "runs", free_ports(3)

    def node(rank: int, secret: str) -> subprocess.Popen:
        return spawn_traceml(
            "run", str(EXAMPLES / "ddp_toy.py"), "--nnodes", "2", "--node-rank", str(rank),
            "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port",
            str(port), "--run-name", "other", "--out", str(out), "--headless", "--",
            "--steps", "60", env={"TRACEML_SECRET": secret})

    p0, p1 = node(0, SECRET), node(1, "ef" * 32)
    try:
        _, err1 = p1.communicate(timeout=150)
        p0.communicate(timeout=60)
    finally:
        for proc in (p0, p1):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    said = [line for line in err1.splitlines() if "failed its handshake" in line]
    assert said and said[0].startswith("[traceml] node 1: "), err1[-3000:]
    assert len(said) <= 8, said  # at powers of two
    doc = json.loads((out / "other" / "final_summary.json").read_text())
    assert doc["complete"] is False and doc["run"]["nodes_never_seen"] == [1]
