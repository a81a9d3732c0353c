"""Issue 40, item 5, against the CUDA double (cuda_double.py): two models in one process
on the CUDA path. The lazy recorder learns the device from the first model's parameters
(its device sources, held weakly), the setup observer starts that model's checksum on
the "GPU"; the script then drops the model and its optimizer and trains another. The
first must be freed, the second's steps must all close and stay timed on the device
(CudaRecorder, its events resolved), with no agent error."""

from __future__ import annotations

import gc
import weakref
from collections import deque

import pytest
import torch
from torch import nn

from cuda_double import CudaDouble, installed_double, on_device
from traceml_agent import hooks
from traceml_agent.checks import StepObserver
from traceml_agent.recorder import FORWARD, OPTIMIZER, CudaRecorder, LazyCudaRecorder


@pytest.fixture
def cuda(monkeypatch):
    yield from installed_double(monkeypatch)


def _model(cls: type = nn.Sequential) -> nn.Module:
    layers = (nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    return on_device(cls(*layers), 1)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()


class Second(nn.Sequential):
    """The next model, of another class (fine-tuning's head on a backbone)."""


def test_two_models_in_one_process_on_the_cuda_path(cuda: CudaDouble) -> None:
    errors: list[BaseException] = []
    out: deque = deque(maxlen=10_000)
    rec = LazyCudaRecorder(out, torch)
    hooks.install(rec, torch, errors.append, StepObserver(0, 1))
    cuda.script_uses(1)
    cuda.set_device(1)
    first = _model()
    opt = torch.optim.Adam(first.parameters())
    _train(first, opt, 5)
    assert type(rec) is CudaRecorder and rec.device == 1  # learned from `first`
    gone, gone_opt = weakref.ref(first), weakref.ref(opt)
    del first, opt
    gc.collect()
    assert gone() is None and gone_opt() is None, "the agent keeps the first model alive"
    second = _model(Second)
    _train(second, torch.optim.Adam(second.parameters()), 7)
    rec.flush(0.5)
    assert not errors and rec.step == 12
    assert [s for s, *_ in out] == list(range(12))  # every step resolved, none dropped
    last = [acc for *_, acc in list(out)[-5:]]
    assert all(acc[FORWARD] is not None and acc[OPTIMIZER] is not None for acc in last), last
