"""End to end: the agent's explicit API, under traceml run and with a hand-started collector."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from jobs import EXAMPLES, free_ports, run_job, validate_schema

pytestmark = pytest.mark.e2e


def _check(doc: dict) -> None:
    validate_schema(doc)
    assert [r["steps"] for r in doc["ranks"]] == [30, 30]
    assert "augment" in doc["phases"]
    for r in doc["ranks"]:
        assert r["phase_ms"]["augment"]["median"] >= 2.0  # it sleeps 2 ms
        assert r["phase_ms"]["sync"] is not None
        assert r["phase_ms"]["h2d"] is None  # never measured: null, not 0


def test_explicit_api_under_traceml_run(tmp_path):
    job = run_job(tmp_path, "explicit_api.py", nproc=2, name="explicit",
                  script_args=("--steps", "30"))
    assert job.returncode == 0, job.stderr[-3000:]
    _check(job.summary)


def test_explicit_api_with_plain_torchrun_and_standalone_collector(tmp_path):
    run_dir = tmp_path / "manual"
    collector = subprocess.Popen(
        [sys.executable, "-m", "traceml_tui", "collector", "--run-dir", str(run_dir),
         "--world-size", "2", "--exit-when-done"], stderr=subprocess.PIPE, text=True)
    try:
        info = run_dir / "collector.json"
        deadline = time.monotonic() + 30
        while not info.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        endpoint = json.loads(info.read_text())["ingest"]
        env = {**os.environ, "TRACEML_ENDPOINT": endpoint, "OMP_NUM_THREADS": "1"}
        job = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--master-port", str(free_ports(1)), str(EXAMPLES / "explicit_api.py"),
             "--steps", "30"],
            env=env, capture_output=True, text=True, timeout=180)
        assert job.returncode == 0, job.stderr[-3000:]
        assert collector.wait(timeout=30) == 0
    finally:
        collector.kill()
    doc = json.loads((run_dir / "final_summary.json").read_text())
    _check(doc)
    assert doc["run"]["exit_code"] == 0
