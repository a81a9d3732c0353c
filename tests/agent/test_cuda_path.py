"""The agent's CUDA rules, checked with real hooks, a real model and a real optimizer on
CPU against a double of `torch.cuda` (cuda_double.py) that logs every call and fails the
way CUDA fails. The rules are in docs/agent-api.md ("CUDA")."""

from __future__ import annotations

import os
import time
from collections import deque

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import traceml_agent
from cuda_double import CudaDouble, on_device
from traceml_agent import hooks, recorder
from traceml_agent.recorder import (
    BACKWARD,
    DATALOADER,
    FORWARD,
    OPTIMIZER,
    CudaRecorder,
    LazyCudaRecorder,
)


@pytest.fixture
def cuda(monkeypatch):
    import torch._dynamo  # noqa: F401 - optimizers import it on first use; with the real
    # torch.cuda, as in any job (its module body reads torch.cuda's types)

    double = CudaDouble(devices=2)
    monkeypatch.setattr(torch, "cuda", double)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    yield double
    hooks.uninstall()


def lazy_agent(errors: list) -> tuple[LazyCudaRecorder, deque]:
    out: deque = deque(maxlen=10_000)
    rec = LazyCudaRecorder(out, torch)
    hooks.install(rec, torch, errors.append, None)
    return rec, out


def train(model: nn.Module, steps: int, loader: object = None) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = iter(loader) if loader is not None else None
    for _ in range(steps):
        x = next(batches)[0] if batches is not None else torch.randn(4, 8)
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()


def test_no_cuda_call_before_the_scripts_own(cuda) -> None:
    errors: list = []
    rec, out = lazy_agent(errors)
    train(nn.Linear(8, 8), 5)  # the script has not touched CUDA yet
    assert cuda.agent_calls() == []
    assert not cuda.is_initialized()
    assert type(rec) is LazyCudaRecorder and len(out) == 5  # timed on the host meanwhile
    assert errors == []


def test_a_scripts_own_cuda_visible_devices_is_honoured(cuda, monkeypatch) -> None:
    """The agent starts first (it is imported at interpreter start-up); the script then
    picks its GPU through CUDA_VISIBLE_DEVICES, which CUDA reads at initialisation."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("TRACEML_ENDPOINT", "tcp://127.0.0.1:9")  # nobody listens: fine
    monkeypatch.delenv("TRACEML_SECRET", raising=False)
    assert traceml_agent.init(run_name="cvd")
    try:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # the script's own choice
        cuda.script_uses(0)
        assert cuda.visible_at_init == "1"
        assert cuda.agent_calls() == []
    finally:
        traceml_agent.shutdown(0)


def test_a_rank_on_cuda_1_without_set_device_never_touches_device_0(cuda) -> None:
    errors: list = []
    rec, out = lazy_agent(errors)
    model = on_device(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)), 1)
    cuda.script_uses(1)  # model.to("cuda:1"), no torch.cuda.set_device(1)
    train(model, 20)
    recorded = [c for c in cuda.agent_calls() if c.api == "Event.record"]
    assert recorded, "no device phase was timed with events"
    assert {c.device for c in recorded} == {1}
    assert 0 not in cuda.contexts
    assert type(rec) is CudaRecorder and rec.device == 1
    assert errors == []
    # Device-timed steps have every device phase.
    last = out[-1]
    for idx in (FORWARD, BACKWARD, OPTIMIZER):
        assert last[3][idx] is not None, (idx, last)


def test_no_cuda_call_from_any_thread_but_the_training_thread(cuda, monkeypatch) -> None:
    """The full agent (sender thread, system sampler, setup checks) on a GPU rank."""
    monkeypatch.setenv("TRACEML_ENDPOINT", "tcp://127.0.0.1:9")
    monkeypatch.delenv("TRACEML_SECRET", raising=False)
    assert traceml_agent.init(run_name="threads")
    try:
        model = on_device(nn.Linear(8, 1), 1)
        cuda.script_uses(1)
        deadline = time.monotonic() + 2.5  # several sender loops and a system sample
        while time.monotonic() < deadline:
            train(model, 10)
    finally:
        traceml_agent.shutdown(0)
    calls = cuda.agent_calls()
    assert any(c.api == "Event.record" for c in calls)
    assert {c.thread for c in calls} == {"MainThread"}, {(c.api, c.thread) for c in calls}


def test_the_ranks_own_allocator_memory_is_sampled_off_thread_without_a_cuda_call(
        cuda, monkeypatch) -> None:
    """NVML's device memory counts every process on the GPU; the sys sample also carries
    this process's allocator figures for the rank's device (cuda:1 here), read by the
    sender thread from host-side counters: no CUDA call, no context on device 0."""
    import threading

    from traceml_agent.sysmetrics import SystemSampler

    cuda.script_uses(1)
    cuda.allocated[1] = (3 << 30, 5 << 30)
    cuda.reserved[1] = 6 << 30
    samples: list = []
    sampler = SystemSampler()
    worker = threading.Thread(target=lambda: (sampler.open_gpu(1),
                                              samples.append(sampler.sample())),
                              name="traceml-sender")
    worker.start()
    worker.join()
    sample = samples[0]
    assert (sample["gpu_alloc_mb"], sample["gpu_reserved_mb"], sample["gpu_peak_mb"]) == (
        3 * 1024, 6 * 1024, 5 * 1024)
    assert sample["device"] == "cuda:1"
    assert cuda.agent_calls() == []
    assert [(r.api, r.thread, r.device) for r in cuda.host_reads] == [
        ("memory_stats", "traceml-sender", 1)]
    assert cuda.contexts == {1}


class CastingDataset(Dataset):
    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.randn(8).to(torch.float16).to(torch.float32), i


def test_forked_workers_of_a_gpu_rank_never_touch_cuda(cuda) -> None:
    """Workers are forked after the script initialised CUDA and the agent learned the
    device: a worker's `.to(float16)` passes the h2d wrapper, which must not record."""
    errors: list = []
    rec, _ = lazy_agent(errors)
    model = on_device(nn.Linear(8, 1), 1)
    cuda.script_uses(1)
    train(model, 3)
    assert type(rec) is CudaRecorder
    loader = DataLoader(CastingDataset(), batch_size=4, num_workers=2,
                        multiprocessing_context="fork")
    train(model, 20, loader)  # a worker raising would surface here
    assert errors == []
    assert {c.pid for c in cuda.calls} == {os.getpid()}


def test_nothing_is_recorded_on_a_capturing_stream_and_nothing_raises(cuda) -> None:
    errors: list = []
    rec, out = lazy_agent(errors)
    model = on_device(nn.Linear(8, 1), 1)
    cuda.script_uses(1)
    cuda.set_device(1)
    train(model, 3)
    cuda.capturing = 1  # e.g. torch.compile(mode="reduce-overhead") records a graph
    train(model, 3)
    cuda.capturing = None
    assert errors == []
    assert rec.capture_skips > 0


def test_flush_on_a_stuck_device_returns_within_its_deadline(cuda) -> None:
    errors: list = []
    rec, _ = lazy_agent(errors)
    model = on_device(nn.Linear(8, 1), 1)
    cuda.script_uses(1)
    train(model, 3)
    cuda.stuck = True  # the GPU hangs in a collective: events never complete
    train(model, 2)
    t0 = time.monotonic()
    rec.flush(deadline_s=0.5)
    assert time.monotonic() - t0 < 2.0
    assert not any(c.api == "Event.synchronize" for c in cuda.agent_calls())


# --- input on the device clock -------------------------------------------------------

MS = 1_000_000


class Clocks:
    """A host clock for the recorder and a device clock for the double's events."""

    def __init__(self) -> None:
        self.host = 0
        self.device = 0


def test_a_batch_fetch_overlapping_device_work_is_not_input_time(cuda, monkeypatch) -> None:
    """The host runs ahead: it fetches the next batch (8 ms) while the device still runs
    the previous step's kernels. The device never waits, so input costs nothing."""
    clocks = Clocks()
    monkeypatch.setattr(recorder, "perf_counter_ns", lambda: clocks.host)
    cuda.device_clock = lambda: clocks.device
    rec = CudaRecorder(deque(), torch, device=1)
    out = rec.out

    def step(fetch_ms: float, device_idle_ms: float) -> None:
        """The fetch on the host; on the device, `device_idle_ms` of idle time, then 10
        ms of forward, backward and optimizer kernels."""
        rec.begin(DATALOADER, "it")
        clocks.host += int(fetch_ms * MS)
        clocks.device += int(device_idle_ms * MS)
        rec.end("it")
        for idx in (FORWARD, BACKWARD, OPTIMIZER):
            rec.begin(idx, idx)
            clocks.host += 1 * MS
            clocks.device += int(10 / 3 * MS)
            rec.end(idx)
        rec.close_step()

    step(8, 0)  # the first step has no previous step-end event: host wall
    for _ in range(3):
        step(8, 0)  # overlapped: the device was busy the whole time
    for _ in range(3):
        step(8, 5)  # the device sat idle 5 ms waiting for the batch
    rec.flush()
    fetched = [r[3][DATALOADER] / MS for r in out]
    assert fetched[1:4] == [0.0, 0.0, 0.0]
    assert [round(v, 3) for v in fetched[4:7]] == [5.0, 5.0, 5.0]
