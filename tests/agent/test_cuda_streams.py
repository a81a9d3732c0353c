"""The step stream (issue 40): every timing event on one stream per rank, checked against
the CUDA double with queued device work (cuda_double.py, `launch`, `wait_stream`), where
an event on an idle stream completes at once as it does on a GPU. Each test compares the
step or phase times the agent sends with the device time the double was given: the
synchronized truth. docs/agent-api.md, "The step stream", states the rule."""

from __future__ import annotations

import statistics
from collections import deque

import pytest
import torch
from torch import nn

from cuda_double import installed_double, on_device
from traceml_agent import hooks
from traceml_agent.recorder import FORWARD, SYNC, CudaRecorder, LazyCudaRecorder

MS = 1_000_000


@pytest.fixture
def cuda(monkeypatch):
    yield from installed_double(monkeypatch)


def one_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_graph_replays_after_a_side_stream_warm_up_time_the_replayed_work(cuda) -> None:
    """PyTorch's whole-network CUDA-graph recipe: warm up inside torch.cuda.stream(side),
    capture, replay on the default stream. Each replay queues 10 ms of device work and
    the host replays in microseconds: the step time is 10 ms, not the launch interval
    (the step clock once stayed on the idle warm-up stream)."""
    errors: list = []
    out: deque = deque(maxlen=10_000)
    rec = LazyCudaRecorder(out, torch)
    hooks.install(rec, torch, errors.append, None)
    model = on_device(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)), 1)
    cuda.script_uses(1)
    cuda.set_device(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    side = cuda.Stream(1)
    with cuda.stream(side):
        for _ in range(4):
            one_step(model, opt)
    cuda.current_stream(1).wait_stream(side)
    g = cuda.CUDAGraph()
    with cuda.graph(g):
        one_step(model, opt)
    g.work_ns = 10 * MS
    first = rec.step
    for _ in range(30):
        g.replay()
    rec.flush()
    assert errors == [] and type(rec) is CudaRecorder
    replayed = [r for r in out if r[0] > first + 1]  # the first replay marks the start
    assert len(replayed) >= 25
    walls = [wall for _, _, wall, _ in replayed]
    assert 9.5 * MS <= statistics.median(walls) <= 10.5 * MS, walls
    assert rec.stream_changes >= 1  # to the side stream for the warm-up, back for replays


def test_a_collective_on_its_own_stream_is_not_charged_as_the_steps_sync(cuda) -> None:
    """FSDP issues its all-gathers inside torch.cuda.stream(its own): the collective's
    kernel (5 ms) overlaps 10 ms of compute the compute stream never waits for. sync is
    the compute stream's exposed wait (none), forward keeps its 10 ms."""
    cuda.script_uses(1)
    cuda.set_device(1)
    rec = CudaRecorder(deque(maxlen=1000), torch, device=1)
    comm = cuda.Stream(1)
    for _ in range(8):
        rec.begin(FORWARD, "fwd")
        cuda.launch(2 * MS)
        with cuda.stream(comm):  # the hooked collective, as FSDP calls it
            rec.begin(SYNC, "all_gather")
            cuda.launch(5 * MS)
            rec.end("all_gather")
        cuda.launch(8 * MS)
        rec.end("fwd")
        rec.close_step()
    rec.flush()
    out = list(rec.out)
    assert len(out) == 8 and rec.timing_faults == 0
    for _, _, wall, phases in out[1:]:
        assert phases[FORWARD] is not None and 9.5 * MS <= phases[FORWARD] <= 10.5 * MS, phases
        assert phases[SYNC] is not None and phases[SYNC] < 0.5 * MS, phases
        assert 9.5 * MS <= wall <= 10.5 * MS


def test_a_device_far_behind_loses_no_step(cuda) -> None:
    """The host 100 steps ahead of the device (graph replays): every step still comes out,
    with its device times once they complete."""
    cuda.script_uses(1)
    rec = CudaRecorder(deque(maxlen=10_000), torch, device=1)
    cuda.lag_ns = 10**15  # nothing completes yet
    for _ in range(100):
        rec.begin(FORWARD, "fwd")
        rec.end("fwd")
        rec.close_step()
    cuda.lag_ns = 0
    rec.flush()
    out = list(rec.out)
    assert [r[0] for r in out] == list(range(100))
    assert all(r[3][FORWARD] is not None for r in out) and rec.late_steps == 0


def test_past_the_pending_bound_a_step_goes_out_on_the_host_clock_and_is_counted(
        cuda) -> None:
    cuda.script_uses(1)
    rec = CudaRecorder(deque(maxlen=10_000), torch, device=1, max_pending=16)
    cuda.lag_ns = 10**15
    for _ in range(50):
        rec.begin(FORWARD, "fwd")
        rec.end("fwd")
        rec.close_step()
        assert len(rec.pending) <= 16
    cuda.lag_ns = 0
    rec.flush()
    out = list(rec.out)
    assert [r[0] for r in out] == list(range(50))
    assert rec.late_steps == 50 - 16
    for _, _, wall, phases in out[:34]:
        assert wall > 0 and phases[FORWARD] is None  # host wall, device phase not measured
    assert all(r[3][FORWARD] is not None for r in out[34:])
