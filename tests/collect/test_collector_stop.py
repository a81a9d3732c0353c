"""A collector told to stop (SIGTERM: scancel, kill, a test's teardown) writes its record
and leaves without waiting the ranks' grace for ranks that are silent or never came."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

from jobs import wait_for
from traceml_tui.collect.collector import FINISH_GRACE_MULTINODE_S


def test_sigterm_with_no_rank_talking_leaves_at_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {**os.environ, "TRACEML_SECRET": secrets.token_hex(32)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "traceml_tui", "collector", "--run-dir", str(run_dir),
         "--world-size", "2", "--nnodes", "2", "--nproc-per-node", "1", "--run-name", "x"],
        env=env, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: (run_dir / "collector.json").exists(), 60, "the collector")
        started = time.monotonic()
        proc.terminate()
        proc.wait(timeout=60)
        took = time.monotonic() - started
    finally:
        proc.kill()
        proc.wait()
    # Before: the whole multi-node grace (10 s) waiting for ranks that never reported.
    assert took < FINISH_GRACE_MULTINODE_S / 2, took
    doc = json.loads((run_dir / "final_summary.json").read_text())
    assert doc["complete"] is False, doc
