"""The real job of tests/report/test_native_stacks.py (its unit tests stay there, so that the
quick loop is the folders without tests/e2e): a rank stuck in C holding the GIL is named
with its native frames (py-spy)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess

import pytest

from jobs import EXAMPLES, kill_session, ptrace_allowed, spawn_traceml, wait_for
from traceml_tui.judge.ingest import NATIVE_THREAD
from traceml_tui.report import summary

pytestmark = pytest.mark.e2e


@pytest.mark.skipif(shutil.which("py-spy") is None, reason="py-spy is not installed")
@pytest.mark.skipif(not ptrace_allowed(), reason="ptrace is forbidden here (Yama scope)")
def test_a_rank_stuck_in_c_holding_the_gil_is_named_with_its_native_frames(tmp_path):
    out = tmp_path / "runs"
    job = spawn_traceml("run", str(EXAMPLES / "ddp_toy.py"), "--nproc-per-node", "2",
                        "--headless", "--out", str(out), "--run-name", "native", "--",
                        "--gil-hang-rank", "1", "--hang-at-step", "30", "--steps", "100000")
    run_dir = out / "native"

    def live() -> dict:
        try:
            return json.loads((run_dir / "live_snapshot.json").read_text())
        except (OSError, ValueError):
            return {}

    def native_stack(doc: dict) -> str:
        threads = ((doc.get("hang") or {}).get("stacks") or {}).get("1") or []
        return next((t["stack"] for t in threads if t["thread"] == NATIVE_THREAD), "")

    try:
        wait_for(lambda: "pause" in native_stack(live()), 120, "rank 1's native stack")
        doc = live()  # while the hang lasts: what a viewer and the record say
    finally:
        job.send_signal(signal.SIGINT)
        try:
            job.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            kill_session(job)
            job.kill()
    hang = doc["hang"]
    assert doc["live_diagnosis"]["label"] == "HANG" and hang["ranks"] == [1], hang
    assert hang["kind"] == "dead" and "rank 1 stopped reporting" in doc["live_diagnosis"]["summary"]
    native = native_stack(doc)
    assert "pause (libc" in native and "block_in_c_holding_the_gil" in native
    text = summary.render_text(doc)
    assert "Rank 1, taken from outside (py-spy --native), innermost call first:" in text
    assert "pause (libc" in text
