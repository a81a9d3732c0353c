"""GPU suite: a compiled optimizer step under `traceml run` (issue 40, item 6).

`torch.compile(opt.step)` traces Optimizer.step's wrapper, where torch calls the global
step hooks: the agent's must be invisible to Dynamo (no graph break of its own, nothing
raised with fullgraph=True) and every compiled step must still close a step, timed on
the device. The CPU version (eager and aot_eager backends): tests/agent/test_compiled_step.py.
"""

from __future__ import annotations

import pytest

from gpu_jobs import assert_healthy, run_gpu, timed

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("fullgraph", [False, True], ids=["adamw-inductor", "fullgraph"])
def test_compiled_optimizer_step(tmp_path, fullgraph):
    steps = 40
    args = ("--steps", str(steps), *(("--fullgraph",) if fullgraph else ()))
    job = run_gpu(tmp_path, "compiled_step.py", name="compiled-step", script_args=args)
    assert f"done {steps} steps" in job.logs, job.tail()
    doc = assert_healthy(job, nproc=1, steps=steps)
    timed(doc["ranks"][0]["phase_ms"], "forward", "backward", "optimizer")
