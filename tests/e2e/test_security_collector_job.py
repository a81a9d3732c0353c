"""The real job of tests/collect/test_security_collector.py (its unit tests stay there, so that
the quick loop is the folders without tests/e2e): a failed /metrics bind is said on the
launcher's terminal."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e


def test_a_failed_metrics_bind_is_said_on_the_launchers_terminal(tmp_path):
    """Before, `--metrics-port` on a port in use was said only in collector.log: the user
    asked for metrics and was told nothing. (One short job, one rank.)"""
    import socket as so

    from jobs import EXAMPLES, traceml

    with so.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen(1)
        busy = squatter.getsockname()[1]
        proc = traceml("run", str(EXAMPLES / "ddp_toy.py"), "--nproc-per-node", "1",
                       "--headless", "--out", str(tmp_path / "runs"), "--run-name", "m",
                       "--metrics-port", str(busy), "--", "--steps", "5", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = [line for line in proc.stderr.splitlines() if "no Prometheus metrics" in line]
    assert said and f"127.0.0.1:{busy}" in said[0], proc.stderr[-2000:]
    assert (tmp_path / "runs" / "m" / "final_summary.json").exists()  # the run went on
