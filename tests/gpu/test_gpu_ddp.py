"""GPU suite: DDP jobs on one GPU under `traceml run` (tests/gpu/jobs/ddp_gpu.py).

Two ranks share the GPU on gloo (NCCL refuses two ranks on one device), one rank runs
NCCL; a compute straggler must be named on the device clock; forked DataLoader workers
and a script that never calls set_device must run with the agent on CUDA.
"""

from __future__ import annotations

import pytest

from gpu_jobs import assert_healthy, run_gpu, timed, visible_gpus

pytestmark = pytest.mark.gpu

STEPS = 80


def test_two_ranks_share_the_gpu_on_gloo(tmp_path):
    job = run_gpu(tmp_path, "ddp_gpu.py", nproc=2, name="gloo2",
                  script_args=("--backend", "gloo", "--steps", str(STEPS)))
    doc = assert_healthy(job, nproc=2, steps=STEPS)
    assert doc["run"]["parallel"] == "ddp"
    for r in doc["ranks"]:
        assert r["device"] == "cuda:0", r  # both ranks on the one GPU
        timed(r["phase_ms"], "dataloader", "h2d", "forward", "backward", "sync", "optimizer")
    assert doc["timing"]["complete"] is True, doc["timing"]
    assert doc["diagnosis"]["label"] not in ("TIMING INCOMPLETE", "HANG"), doc["diagnosis"]
    assert f"traceml run gloo2: 2 rank(s), {STEPS} steps" in job.stdout


def test_one_rank_on_nccl(tmp_path):
    import torch.distributed as dist

    if not dist.is_nccl_available():
        pytest.skip("this torch build has no NCCL")
    job = run_gpu(tmp_path, "ddp_gpu.py", nproc=1, name="nccl1",
                  script_args=("--backend", "nccl", "--steps", str(STEPS)))
    doc = assert_healthy(job, nproc=1, steps=STEPS)
    rank = doc["ranks"][0]
    assert rank["device"] == "cuda:0", rank
    timed(rank["phase_ms"], "forward", "backward", "optimizer")
    assert doc["timing"]["complete"] is True, doc["timing"]


def test_compute_straggler_is_named_on_device_time(tmp_path):
    """Rank 1 runs extra GPU matmuls inside its forward. Its host returns from the
    launches at once and blocks later, in the allreduce (gloo copies CUDA tensors to the
    host): on the host clock the extra work would land in backward or sync. Only the
    device clock puts it in forward, where it is."""
    job = run_gpu(tmp_path, "ddp_gpu.py", nproc=2, name="straggler",
                  script_args=("--backend", "gloo", "--steps", "150", "--straggler-rank", "1",
                               "--extra-matmuls", "60"))
    doc = assert_healthy(job, nproc=2, steps=150)
    d = doc["diagnosis"]
    assert (d["label"], d["rank"], d["phase"]) == ("COMPUTE STRAGGLER", 1, "forward"), d
    fwd = [r["phase_ms"]["forward"]["median"] for r in doc["ranks"]]
    assert fwd[1] > fwd[0] + 2.0, fwd  # the extra matmuls are device time in forward
    assert "Diagnosis: COMPUTE STRAGGLER" in job.stdout


def test_forked_dataloader_workers_with_the_agent_on_cuda(tmp_path):
    """Workers forked after the parent used CUDA: the agent's hooks in them stay inert
    (CUDA cannot be re-initialised after a fork), and the parent's input wait is timed."""
    job = run_gpu(tmp_path, "ddp_gpu.py", nproc=2, name="workers",
                  script_args=("--backend", "gloo", "--steps", str(STEPS), "--workers", "2",
                               "--batch", "64"))
    doc = assert_healthy(job, nproc=2, steps=STEPS)
    assert "re-initialize CUDA" not in job.seen, job.tail()
    for r in doc["ranks"]:
        timed(r["phase_ms"], "dataloader", "forward", "backward", "optimizer")


def test_no_set_device_learns_the_device_from_the_model(tmp_path):
    """model.to(f"cuda:{local_rank}") and no set_device: the device is learned from the
    parameters, and every phase is timed there. On one GPU the current device (0) and
    the model's are the same, so the test could not fail: it needs two (issue 40, 8)."""
    gpus = visible_gpus()
    if len(gpus) < 2:
        pytest.skip("needs two GPUs: on one, the model's device is the current device")
    job = run_gpu(tmp_path, "ddp_gpu.py", nproc=2, name="noset",
                  script_args=("--backend", "gloo", "--steps", str(STEPS), "--no-set-device"),
                  env={"CUDA_VISIBLE_DEVICES": ",".join(gpus[:2])})
    doc = assert_healthy(job, nproc=2, steps=STEPS)
    assert "current device 0, model on cuda:1" in job.logs, job.tail()
    for r in doc["ranks"]:
        assert r["device"] == f"cuda:{r['rank']}", r
        timed(r["phase_ms"], "forward", "backward", "sync", "optimizer")
