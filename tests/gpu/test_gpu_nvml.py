"""GPU suite: the agent's NVML figures against `nvidia-smi` on the same GPU, while a job
holds a known amount of memory and keeps the GPU busy (tests/gpu/jobs/nvml_hold.py).

The GPU is found by the UUID torch reports for the rank's device (so a wrong index,
CUDA's fastest-first order against NVML's PCI order, would compare two different GPUs
and fail on a multi-GPU machine). Memory: NVML's "used" counts every process on the
GPU; nvidia-smi's leaves out the driver's reserved memory on recent drivers, so the
tolerance is that reserved amount plus 256 MiB. Utilisation: both sample a busy GPU;
their medians must agree within 25 points.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpu_jobs import JOBS, ROOT, GpuRun, assert_healthy, nvidia_smi, one_gpu_env
from jobs import kill_session, wait_for

pytestmark = pytest.mark.gpu

HOLD_MB = 4096
SAMPLES = 5
MEM_SLACK_MB = 256.0
UTIL_POINTS = 25.0
TEMP_C = 8.0


def _live_sys(run_dir: Path) -> dict[str, Any]:
    try:
        doc = json.loads((run_dir / "live_snapshot.json").read_text())
        return doc["ranks"][0]["sys"] or {}
    except (OSError, ValueError, KeyError, IndexError):
        return {}


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0


def _smi_gpu(uuid: str) -> str:
    """nvidia-smi's id for the GPU whose UUID torch reported."""
    rows = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
                          capture_output=True, text=True, timeout=30, check=True).stdout
    want = uuid.removeprefix("GPU-").lower()
    for row in rows.strip().splitlines():
        index, smi_uuid = (v.strip() for v in row.split(","))
        if smi_uuid.lower().removeprefix("gpu-") == want:
            return smi_uuid
    raise AssertionError(f"torch's device UUID {uuid} is not among nvidia-smi's GPUs:\n{rows}")


SMI_FIELDS = {"used": "memory.used", "total": "memory.total", "reserved": "memory.reserved",
              "util": "utilization.gpu", "temp": "temperature.gpu", "power": "power.draw",
              "sm_clock": "clocks.sm"}


def _smi(gpu: str) -> dict[str, float | None]:
    """nvidia-smi's figures (MiB, %, °C, W, MHz; None where it says [N/A] or, for
    memory.reserved, where this nvidia-smi does not know the field)."""
    fields = dict(SMI_FIELDS)
    try:
        row = nvidia_smi(*fields.values(), gpu=gpu)
    except subprocess.CalledProcessError:  # an older nvidia-smi without memory.reserved
        del fields["reserved"]
        row = nvidia_smi(*fields.values(), gpu=gpu)

    def num(field: str) -> float | None:
        try:
            return float(row[field])
        except (KeyError, ValueError):
            return None

    return {key: num(SMI_FIELDS[key]) for key in SMI_FIELDS}


def _wait_job(condition, proc: subprocess.Popen, timeout: float, what: str) -> None:
    """wait_for, failing at once with the job's output if the job ends first."""
    def done() -> bool:
        if proc.poll() is not None and not condition():
            out, err = proc.communicate()
            raise AssertionError(f"the job ended (exit {proc.returncode}) before {what}:\n"
                                 f"{out[-2000:]}\n{err[-3000:]}")
        return condition()

    wait_for(done, timeout, what)


def test_nvml_figures_match_nvidia_smi(tmp_path):
    info, stop = tmp_path / "info.json", tmp_path / "stop"
    out, name = tmp_path / "runs", "nvml"
    run_dir = out / name
    live = run_dir / "live_snapshot.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "traceml_tui", "run", str(JOBS / "nvml_hold.py"), "--headless",
         "--out", str(out), "--run-name", name, "--", "--info", str(info), "--stop-file",
         str(stop), "--hold-mb", str(HOLD_MB)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1", **one_gpu_env()})
    pairs: list[tuple[dict[str, Any], dict[str, float | None]]] = []
    try:
        _wait_job(info.exists, proc, 180, "the job held its memory")
        torch_uuid = json.loads(info.read_text())["uuid"]
        gpu = _smi_gpu(torch_uuid)
        _wait_job(lambda: (_live_sys(run_dir).get("gpu_mem_mb") is not None
                          and (_live_sys(run_dir).get("gpu_alloc_mb") or 0) >= HOLD_MB),
                  proc, 90, "NVML and allocator figures were in the live snapshot")
        for _ in range(SAMPLES):
            seen = _mtime(live)
            _wait_job(lambda seen=seen: _mtime(live) != seen, proc, 30, "a newer live snapshot")
            pairs.append((_live_sys(run_dir), _smi(gpu)))
        stop.touch()
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            kill_session(proc)
            proc.communicate()

    print("\nagent (NVML) vs nvidia-smi: memory MiB, utilisation %, °C, W, SM MHz")
    for agent, smi in pairs:
        print(f"  used {agent['gpu_mem_mb']:.0f} vs {smi['used']} (reserved {smi['reserved']})"
              f"  total {agent['gpu_mem_total_mb']:.0f} vs {smi['total']}"
              f"  util {agent['gpu_util']} vs {smi['util']}"
              f"  temp {agent.get('temp_c')} vs {smi['temp']}"
              f"  power {agent.get('power_w')} vs {smi['power']}"
              f"  sm clock {agent.get('sm_clock_mhz')} vs {smi['sm_clock']}"
              f"  own allocator {agent['gpu_alloc_mb']:.0f}  throttle {agent.get('throttle')}")
    # NVML sampled the GPU torch trains on (issue 29 finding 6: by the UUID torch reports).
    for agent, _ in pairs:
        assert (agent.get("gpu_uuid") or "").lower().removeprefix("gpu-") == \
            gpu.lower().removeprefix("gpu-"), (agent.get("gpu_uuid"), gpu, torch_uuid)
    for agent, smi in pairs:
        slack = MEM_SLACK_MB + (smi["reserved"] if smi["reserved"] is not None else 768.0)
        assert abs(agent["gpu_mem_mb"] - smi["used"]) <= slack, (agent, smi)
        assert abs(agent["gpu_mem_total_mb"] - smi["total"]) <= slack, (agent, smi)
        # This process's own memory is part of what the GPU has in use.
        assert HOLD_MB <= agent["gpu_alloc_mb"] <= agent["gpu_reserved_mb"] <= agent[
            "gpu_mem_mb"] + 1, agent
    utils = [(a["gpu_util"], s["util"]) for a, s in pairs
             if a["gpu_util"] is not None and s["util"] is not None]
    assert utils, pairs  # a whole GPU (not a MIG instance) reports utilisation
    agent_util = statistics.median(a for a, _ in utils)
    smi_util = statistics.median(s for _, s in utils)
    assert agent_util >= 50, utils  # the job keeps the GPU busy
    assert abs(agent_util - smi_util) <= UTIL_POINTS, utils
    temps = [(a.get("temp_c"), s["temp"]) for a, s in pairs
             if a.get("temp_c") is not None and s["temp"] is not None]
    assert all(abs(a - s) <= TEMP_C for a, s in temps), temps  # slow to change: close

    job = GpuRun(proc.returncode, stdout, stderr, run_dir)
    doc = assert_healthy(job, nproc=1)
    final = doc["ranks"][0]["sys"]
    assert final["gpu_mem_mb"] is not None and final["gpu_util"] is not None, final
