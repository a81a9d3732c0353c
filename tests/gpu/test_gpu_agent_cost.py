"""GPU suite: the agent's host cost on the GPU (issue 29, finding 8), measured by
benchmarks/gpu_agent_cost.py, run briefly here; the figures are printed for
docs/gpu-validation.md's table (run with -s to see them as they come)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from gpu_jobs import ROOT, one_gpu_env

pytestmark = pytest.mark.gpu


def test_agent_cost_per_event_and_per_step(capsys):
    import os

    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_agent_cost.py"), "--events", "5000",
         "--rounds", "4", "--steps", "200"],
        cwd=ROOT, capture_output=True, text=True, timeout=400,
        env={**os.environ, "OMP_NUM_THREADS": "1", **one_gpu_env()})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    with capsys.disabled():
        print(f"\n{proc.stdout}")
    event, phase, step = result["per_event"], result["per_phase"], result["per_step"]
    # The CUDA path was measured: the agent switched to its device recorder.
    assert step["recorder"] == "CudaRecorder", step
    figures = [event["record_us"], event["agent_event_us"], phase["phase_us"],
               step["bare_us"], step["agent_us"], step["overhead_us_median"]]
    assert all(math.isfinite(f) for f in figures), result
    assert 0 < event["record_us"] <= event["agent_event_us"], event
    assert phase["steps_resolved"] > 0, phase  # steps were resolved with query(), no sync
