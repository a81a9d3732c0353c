"""The real job of tests/launch/test_slurm.py (its unit tests stay there, so that the quick
loop is the folders without tests/e2e): one srun line runs two nodes."""

from __future__ import annotations

import json
import socket

import pytest

from jobs import EXAMPLES, spawn_traceml
from traceml_tui.launch.slurm import PORT_BASE, PORT_SPAN

pytestmark = pytest.mark.e2e


def _slurm_job_id_with_free_ports() -> int:
    """A job id whose derived ports (torchrun's, the collector's, the viewers') are free."""
    for job_id in range(7100, 7100 + 200, 3):
        port = PORT_BASE + job_id % PORT_SPAN
        try:
            for p in (port, port + 1, port + 2):
                with socket.socket() as s:
                    s.bind(("0.0.0.0", p))
        except OSError:
            continue
        return job_id
    pytest.skip("no free ports for a Slurm job id")


def test_one_srun_line_runs_two_nodes(tmp_path):
    """What srun does on a 2-node allocation, by hand: the same command on both "nodes",
    only SLURM_NODEID differs; no node flags, no run name."""
    job_id = _slurm_job_id_with_free_ports()
    out = tmp_path / "runs"
    base = {"SLURM_JOB_ID": str(job_id), "SLURM_STEP_ID": "0", "SLURM_NNODES": "2",
            "SLURM_JOB_NODELIST": "localhost,localhost", "SLURM_TASKS_PER_NODE": "1(x2)",
            "SLURM_GPUS_ON_NODE": "2"}
    args = ("run", str(EXAMPLES / "ddp_toy.py"), "--out", str(out), "--headless",
            "--", "--steps", "40")
    nodes = [spawn_traceml(*args, env={**base, "SLURM_NODEID": str(k)}) for k in (1, 0)]
    results = [p.communicate(timeout=150) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], results[1][1][-3000:]
    run_dir = out / f"ddp_toy-slurm{job_id}"
    doc = json.loads((run_dir / "final_summary.json").read_text())
    assert doc["run"]["world_size"] == 4 and doc["run"]["nnodes"] == 2
    assert [r["steps"] for r in doc["ranks"]] == [40] * 4
