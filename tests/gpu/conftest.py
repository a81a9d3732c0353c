"""The GPU suite (`python -m pytest -m gpu`): real `traceml run` jobs on one NVIDIA GPU.

Every test here marked `gpu` is skipped, with the reason, where there is no GPU to run
it on: torch without CUDA, no device, or no `nvidia-smi` (gpu_jobs.missing_gpu). The
check runs in the test process and creates no CUDA context: the jobs own the GPU.
docs/gpu-validation.md says what each test checks.
"""

from __future__ import annotations

import pytest

from gpu_jobs import missing_gpu


@pytest.fixture(autouse=True)
def _needs_gpu(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("gpu") is not None:
        reason = missing_gpu()
        if reason is not None:
            pytest.skip(reason)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ARG001
    """One line saying why the GPU tests were skipped, even under -q (which hides skip
    reasons): "N passed" must not read as "the GPU path works"."""
    skipped = [r for r in terminalreporter.stats.get("skipped", [])
               if "gpu/test_gpu_" in getattr(r, "nodeid", "")]
    reason = missing_gpu()
    if skipped and reason is not None:
        terminalreporter.write_line(f"GPU suite: {len(skipped)} test(s) skipped: {reason}")
