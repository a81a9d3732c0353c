"""End to end: `traceml watch` attaches to a real `traceml run` job and sees every rank;
quitting the viewer leaves the job running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from jobs import EXAMPLES, live_steps, traceml, wait_for
from traceml_tui.dashboard import DashboardApp
from traceml_tui.view_client import ViewClient, resolve_target

pytestmark = pytest.mark.e2e


async def test_watch_a_real_run_sees_all_ranks_and_quitting_leaves_it_running(tmp_path):
    out = tmp_path / "runs"
    job = subprocess.Popen(
        [sys.executable, "-m", "traceml_tui", "run", str(EXAMPLES / "ddp_toy.py"),
         "--nproc-per-node", "3", "--headless", "--out", str(out), "--run-name", "w", "--",
         "--scenario", "forward", "--rank", "2", "--steps", "1000000"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    run_dir = out / "w"
    try:
        wait_for(lambda: live_steps(run_dir) >= 40, 120)
        address, found_dir, secret = resolve_target(None, out)  # `traceml watch`, no argument
        assert found_dir == run_dir
        app = DashboardApp(ViewClient(address, secret=secret), found_dir, refresh_s=0.2)
        async with app.run_test(size=(140, 44)) as pilot:
            for _ in range(100):
                await pilot.pause(0.1)
                if app.state is not None and app.state.label == "COMPUTE STRAGGLER":
                    break
            state = app.state
            assert state is not None
            assert [r.rank for r in state.rows] == [0, 1, 2]
            assert state.reporting == 3
            assert (state.label, state.rank) == ("COMPUTE STRAGGLER", 2)
            await pilot.press("q")
        before = live_steps(run_dir)
        wait_for(lambda: live_steps(run_dir) > before + 10, 30)  # the job goes on
        assert job.poll() is None
    finally:
        job.send_signal(signal.SIGINT)
        job.wait(60)
    assert (run_dir / "final_summary.json").exists()


@pytest.mark.parametrize(("target", "message"), [
    ("no/such/dir", "no such run folder"),
    (".", "not a traceml run folder"),
])
def test_watch_bad_targets_are_one_clear_line(tmp_path, target, message):
    proc = traceml("watch", target, cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_watch_with_no_live_run(tmp_path):
    proc = traceml("watch", cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert "no live run" in proc.stderr


def test_watch_from_another_node_uses_the_address_node_0_advertised(tmp_path, monkeypatch):
    """On a shared run folder, collector.json's loopback view address is node 0's own: a
    viewer on another host must use the advertised one."""
    import json
    import socket

    from traceml_tui.view_client import resolve_target

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "collector.json").write_text(json.dumps({
        "view": "tcp://127.0.0.1:31744", "view_remote": "tcp://gpu01:31744",
        "host": "gpu01"}))
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu02")
    assert resolve_target(str(run_dir))[0] == "tcp://gpu01:31744"
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu01")
    assert resolve_target(str(run_dir))[0] == "tcp://127.0.0.1:31744"
