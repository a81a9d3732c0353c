"""The GPU suite (`python -m pytest -m gpu`): real `traceml run` jobs on one NVIDIA GPU.

Every test here marked `gpu` is skipped, with the reason, where there is no GPU to run
it on: torch without CUDA, no device, or no `nvidia-smi` (gpu_jobs.missing_gpu). The
check runs in the test process and creates no CUDA context: the jobs own the GPU.
docs/gpu-validation.md says what each test checks.

The suite is collectable with only the product's runtime dependencies and pytest (a bare
GPU box; nothing from the test extra at module level here, nor in gpu_jobs.py and the
jobs/ helpers it imports). It runs in EVIDENCE order, the most telling test per second
first, so that one command of limited length (a lent GPU's 10 minutes) gives the most
evidence: `--gpu-budget-s S` keeps only the tests whose estimated seconds fit S, in that
order, and says which it left out.
"""

from __future__ import annotations

import pytest

from gpu_jobs import EVIDENCE_ORDER, UNKNOWN_S, missing_gpu


def _plan_key(item: pytest.Item) -> tuple[int, float]:
    ident = f"{item.path.name}::{item.name}"
    for rank, (name, seconds, _) in enumerate(EVIDENCE_ORDER):
        if name == ident:
            return rank, seconds
    return len(EVIDENCE_ORDER), UNKNOWN_S


@pytest.hookimpl(trylast=True)  # after tests/conftest.py's cost order, which it overrides
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu = [i for i in items if i.get_closest_marker("gpu") is not None]
    if not gpu:
        return
    rest = [i for i in items if i.get_closest_marker("gpu") is None]
    gpu.sort(key=_plan_key)
    budget = config.getoption("--gpu-budget-s", default=None)
    left: list[pytest.Item] = []
    if budget is not None:
        kept, spent = [], 0.0
        for item in gpu:
            seconds = _plan_key(item)[1]
            if spent + seconds <= budget:
                kept.append(item)
                spent += seconds
            else:
                left.append(item)
        gpu = kept
        if left:
            config.hook.pytest_deselected(items=left)
    config.stash[_LEFT] = [f"{i.path.name}::{i.name}" for i in left]
    items[:] = rest + gpu


_LEFT = pytest.StashKey[list]()


@pytest.fixture(autouse=True)
def _needs_gpu(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("gpu") is not None:
        reason = missing_gpu()
        if reason is not None:
            pytest.skip(reason)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ARG001
    """One line saying why the GPU tests were skipped, even under -q (which hides skip
    reasons): "N passed" must not read as "the GPU path works". And the tests a budget
    left out, by name: they were not run, which is not a pass."""
    skipped = [r for r in terminalreporter.stats.get("skipped", [])
               if "gpu/test_gpu_" in getattr(r, "nodeid", "")]
    reason = missing_gpu()
    if skipped and reason is not None:
        terminalreporter.write_line(f"GPU suite: {len(skipped)} test(s) skipped: {reason}")
    left = config.stash.get(_LEFT, [])
    if left:
        terminalreporter.write_line(
            f"GPU suite: {len(left)} test(s) left out by --gpu-budget-s "
            f"{config.getoption('--gpu-budget-s'):g}: " + ", ".join(left))
