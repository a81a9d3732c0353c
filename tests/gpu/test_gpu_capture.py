"""GPU suite: CUDA graphs under `traceml run` (issue 29, findings 1 and 2).

A whole-step `torch.cuda.graph` capture in PyTorch's default "global" mode fails if
any thread makes a prohibited CUDA call during it (an event query, say): the agent must
make none, so the capture succeeds and the script goes on. The replays that follow call
no module, no backward and no optimizer.step() in Python: the job is healthy and must
never read as a HANG. And torch.compile(mode="reduce-overhead") captures graphs of its
own.
"""

from __future__ import annotations

import re

import pytest

from gpu_jobs import assert_healthy, hang_labels, run_gpu, timed

pytestmark = pytest.mark.gpu

WARMUP = 5


@pytest.mark.parametrize("source", ["tensors", "loader"])
def test_whole_step_graph_capture_and_replay(tmp_path, source):
    """Replays for 8 s with --hang-after 3: a rank that only replays must not be HANG.
    Issue 29 lets the agent either count the replays as steps or say that steps are not
    visible and suspend hang detection for the rank, with the reason shown."""
    name = f"graph-{source}"
    job = run_gpu(tmp_path, "graph_step.py", "--hang-after", "3", name=name,
                  script_args=("--seconds", "8", "--warmup", str(WARMUP), "--mode", "global",
                               "--source", source))
    # The capture itself: `with torch.cuda.graph(...)` raises in the script otherwise.
    assert "capture ok (mode global)" in job.logs, job.tail()
    replayed = re.search(r"replayed (\d+) times: loss ([\d.]+) -> ([\d.]+)", job.logs)
    assert replayed is not None, job.tail()
    doc = assert_healthy(job, nproc=1)  # exit 0, agent on, never a HANG
    assert hang_labels(doc) == []
    rank = doc["ranks"][0]
    replays = int(replayed.group(1))
    # The agent stepped aside during the capture (and counted what it left untimed).
    assert rank["capture_skips"] > 0, rank
    # Replays seen (the last heartbeat may be up to a second, an eighth of them, behind),
    # and progress visible: each replay outside a phase is a step (docs/agent-api.md,
    # "Graph replay is progress"), or the rank says its steps are hidden and hang
    # detection is suspended.
    assert rank["replays"] >= 0.5 * replays, (rank["replays"], replays)
    assert rank["steps"] >= 0.5 * replays or rank["steps_hidden"], (rank["steps"], replays)
    if rank["steps_hidden"]:
        assert f"{rank['steps_hidden']} (hang detection suspended)" in job.stdout


def test_compile_reduce_overhead(tmp_path):
    """torch.compile's CUDA graphs (cudagraph trees) are captured during the first steps
    and replayed after: the job finishes, every step is counted, the agent stays on, and
    the replayed steps are timed (forward is the compiled module's call)."""
    steps = 60
    job = run_gpu(tmp_path, "compiled.py", name="compiled", script_args=("--steps", str(steps)))
    assert f"done {steps} steps" in job.logs, job.tail()
    doc = assert_healthy(job, nproc=1, steps=steps)
    timed(doc["ranks"][0]["phase_ms"], "forward", "backward", "optimizer")
