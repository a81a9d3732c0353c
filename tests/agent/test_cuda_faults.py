"""Issue 29's GPU-path findings, each against a CUDA double that is no kinder than CUDA
(cuda_double.py): capture error modes, events that complete late, skewed streams,
autograd's device thread, a background prefetch thread. Real hooks, real model, real
optimizer on CPU; every agent CUDA call is logged by the double."""

from __future__ import annotations

import threading
import time
from collections import deque
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import traceml_agent
from cuda_double import (
    AUTOGRAD_THREAD,
    CudaDouble,
    background_batches,
    backward_on_device_thread,
    installed_double,
    on_device,
)
from traceml_agent import checks, hooks, recorder
from traceml_agent.capture import Capturer
from traceml_agent.checks import StepObserver
from traceml_agent.recorder import (
    BACKWARD,
    DATALOADER,
    FORWARD,
    OPTIMIZER,
    SYNC,
    CudaRecorder,
    LazyCudaRecorder,
    Recorder,
)

MS = 1_000_000


@pytest.fixture
def cuda(monkeypatch):
    yield from installed_double(monkeypatch)


def agent(errors: list, observer: StepObserver | None = None
          ) -> tuple[LazyCudaRecorder, deque]:
    out: deque = deque(maxlen=10_000)
    rec = LazyCudaRecorder(out, torch)
    hooks.install(rec, torch, errors.append, observer)
    return rec, out


def gpu_model(cuda: CudaDouble) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = on_device(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)), 1)
    cuda.script_uses(1)
    cuda.set_device(1)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def one_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor | None = None
             ) -> None:
    model(torch.randn(4, 8) if x is None else x).sum().backward()
    opt.step()
    opt.zero_grad()


def calls_during(cuda: CudaDouble, start: int) -> list:
    return [(c.api, c.module) for c in cuda.calls[start:] if c.module.startswith("traceml")]


# --- the double itself fails as CUDA does ---------------------------------------------


@pytest.mark.parametrize("mode,other_thread,raises", [
    ("global", False, True), ("global", True, True),
    ("thread_local", False, True), ("thread_local", True, False),
    ("relaxed", False, False), ("relaxed", True, False)])
def test_the_double_refuses_unsafe_calls_as_cuda_capture_modes_do(
        cuda, mode, other_thread, raises) -> None:
    cuda.script_uses(0)
    ev = cuda.Event(enable_timing=True)
    ev.record()
    g = cuda.CUDAGraph()
    g.capture_begin(capture_error_mode=mode)
    got: list = []

    def query() -> None:
        try:
            ev.query()
            got.append(None)
        except RuntimeError as exc:
            got.append(exc)

    if other_thread:
        worker = threading.Thread(target=query)
        worker.start()
        worker.join()
    else:
        query()
    assert (got[0] is not None) == raises
    if raises:  # the capture is invalidated: the user's capture_end raises
        with pytest.raises(RuntimeError, match="previous error during capture"):
            g.capture_end()
    else:
        g.capture_end()


def test_the_double_lags_and_skews_like_a_gpu(cuda) -> None:
    cuda.script_uses(0)
    cuda.lag_ns = 10_000 * MS
    a, b = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
    side = cuda.Stream(skew_ns=-5 * MS)
    a.record()
    b.record(side)
    assert not a.query()
    with pytest.raises(RuntimeError, match="not ready"):
        a.elapsed_time(b)
    cuda.lag_ns = 0
    assert a.query() and a.elapsed_time(b) < 0


# --- finding 1: a whole-step capture must survive the agent ------------------------------


def test_a_whole_step_capture_in_global_mode_with_events_pending_survives(cuda) -> None:
    """torch.cuda.graph's default mode is global: one event query by the agent during the
    capture (its step close resolves earlier steps) invalidates it and the user's
    `with torch.cuda.graph(g):` raises."""
    errors: list = []
    rec, out = agent(errors)
    model, opt = gpu_model(cuda)
    cuda.lag_ns = 10_000 * MS  # a real GPU runs behind: the warm-up steps' events pend
    for _ in range(4):
        one_step(model, opt)
    assert type(rec) is CudaRecorder and rec.pending
    g = cuda.CUDAGraph()
    start = len(cuda.calls)
    with cuda.graph(g):  # raises if the agent broke the capture
        one_step(model, opt)
    assert calls_during(cuda, start) == []
    assert errors == []
    assert rec.capture_skips > 0
    cuda.lag_ns = 0
    one_step(model, opt)
    rec.flush()
    # The captured step is sent with its device phases not timed, never guessed.
    captured = [r for r in out if r[0] == 4]
    assert captured and all(captured[0][3][i] is None for i in (FORWARD, BACKWARD, OPTIMIZER))


class FakeProfiler:
    """torch.profiler.profile: its start and stop are CUDA calls (CUPTI) on a GPU."""

    def __init__(self, cuda: CudaDouble, log: list) -> None:
        self.cuda, self.log = cuda, log

    def start(self) -> None:
        self.log.append(("start", self.cuda.capturing))
        self.cuda._api("profiler.start", None, caller="traceml_agent.capture",
                       unsafe_in_capture=True)

    def stop(self) -> None:
        self.log.append(("stop", self.cuda.capturing))
        self.cuda._api("profiler.stop", None, caller="traceml_agent.capture",
                       unsafe_in_capture=True)

    def export_chrome_trace(self, path: str) -> None:
        with open(path, "w") as f:
            f.write("{}")


def test_no_agent_cuda_call_from_any_entry_point_during_a_global_capture(
        cuda, monkeypatch, tmp_path) -> None:
    """Every entry point of the agent, driven while a global-mode capture is in
    progress: the DataLoader, h2d, forward, backward (first-gradient hook and final
    callback), a collective, the optimizer hooks and the step close with its resolve,
    the weight checksum's start and poll, the deep trace's start and stop, flush."""
    import torch.distributed as dist

    prof_log: list = []
    monkeypatch.setattr(torch.profiler, "profile",
                        lambda activities=None: FakeProfiler(cuda, prof_log))
    observer = StepObserver(0, 1)
    errors: list = []
    rec, out = agent(errors, observer)
    model, opt = gpu_model(cuda)
    loader = DataLoader([(torch.randn(8), 0) for _ in range(64)], batch_size=4)
    batches = iter(loader)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    capturer = Capturer(0, str(tmp_path), torch, rec)
    try:
        def step() -> None:
            x = next(batches)[0].to(torch.float16).to(torch.float32)  # h2d hook: a cast
            dist.all_reduce(torch.ones(1))
            one_step(model, opt, x)

        for _ in range(3):
            step()
        assert type(rec) is CudaRecorder
        # A GPU weight checksum in flight (pinned copy behind an event), polled at steps.
        weight = on_device(nn.Linear(1, 1, bias=False), 1).weight
        total = type(weight)(torch.tensor(1.5, dtype=torch.float64), requires_grad=False)
        monkeypatch.setattr(checks, "_checksum_tensor", lambda module: total)
        pending = checks._PendingChecksum.start(model)
        assert pending is not None and pending.event is not None
        observer._in_flight.append(pending)
        cuda.lag_ns = 10_000 * MS  # events pend from here on

        for trace_state in ("start pending", "stop pending"):
            if trace_state == "start pending":
                assert capturer.request(1, 1)
            else:  # started at a step outside the capture; its stop falls inside one
                step()
                assert [e for e in prof_log if e[0] == "start"]
            step()  # outside the capture: events pend
            g = cuda.CUDAGraph()
            start = len(cuda.calls)
            with cuda.graph(g):  # the user's capture: raises if anyone broke it
                step()
                assert checks._PendingChecksum.start(model) is None
                rec.flush(deadline_s=0.05)
            assert calls_during(cuda, start) == [], trace_state
        cuda.lag_ns = 0
        step()
        rec.flush()
    finally:
        dist.destroy_process_group()
    assert errors == []
    assert [state for _, state in prof_log] == [None, None]  # neither inside a capture
    assert [e[0] for e in prof_log] == ["start", "stop"]
    assert pending.value is not None  # read after the captures
    assert rec.capture_skips > 0 and len(out) > 5


# --- finding 2: graph replay is progress ----------------------------------------------


def test_replaying_a_whole_step_graph_closes_steps_on_the_device_clock(cuda) -> None:
    errors: list = []
    rec, out = agent(errors)
    model, opt = gpu_model(cuda)
    for _ in range(3):
        one_step(model, opt)
    g = cuda.CUDAGraph()
    with cuda.graph(g):
        one_step(model, opt)
    step_before = rec.step
    t_before = rec.last_step_t
    for _ in range(20):  # static_x.copy_(batch); g.replay(): no module call, no hook
        g.replay()
    rec.flush()
    assert errors == []
    assert rec.replays == 20
    assert rec.step >= step_before + 19  # the first replay only marks where steps begin
    assert rec.last_step_t > t_before  # the heartbeat's since_step moves: not a hang
    replayed = [r for r in out if r[0] > step_before]
    assert len(replayed) >= 18
    for _, _, wall, phases in replayed:
        assert wall >= 0
        assert all(phases[i] is None for i in (FORWARD, BACKWARD, SYNC, OPTIMIZER))


def test_a_graph_replayed_inside_a_phase_does_not_close_extra_steps(cuda) -> None:
    """torch.compile's cudagraph trees replay inside forward and backward: the step still
    closes once, at the optimizer."""
    errors: list = []
    rec, out = agent(errors)
    model, opt = gpu_model(cuda)
    g = cuda.CUDAGraph()
    with cuda.graph(g):
        pass

    class Replaying(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            g.replay()
            return self.inner(x)

    root = Replaying()
    for _ in range(6):
        one_step(root, opt)
    assert rec.replays == 6 and rec.step == 6 and errors == []


# --- finding 3: one clock, one stream, never a negative phase ----------------------------


def test_a_phase_ending_on_a_side_stream_is_timed_on_the_step_stream(cuda) -> None:
    """Every event goes on the step stream (issue 40), whatever stream is current when
    the phase ends: no pair spans two streams, so none comes out negative or faulty."""
    cuda.script_uses(1)
    rec = CudaRecorder(deque(), torch, device=1)
    side = cuda.Stream(1, skew_ns=-5 * MS)  # a side stream running at other times
    for i in range(6):
        rec.begin(FORWARD, "fwd")  # on the default stream
        with cuda.stream(side):  # the forward ends on a side stream (FSDP, a prefetcher)
            rec.end("fwd")
            if i % 2:
                rec.close_step()  # and the loop ends some steps there too
        if not i % 2:
            rec.close_step()
    rec.flush()
    out = list(rec.out)
    assert len(out) == 6
    for _, _, wall, phases in out:
        assert wall >= 0
        assert all(v is None or v >= 0 for v in phases)
    assert all(r[3][FORWARD] is not None for r in out[1:])
    assert rec.timing_faults == 0 and rec.stream_changes == 0


def test_a_pair_across_streams_is_a_timing_fault_never_a_negative_value(cuda) -> None:
    from traceml_agent.recorder import _elapsed_ns

    cuda.script_uses(1)
    side = cuda.Stream(1, skew_ns=-5 * MS)
    a, b = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
    a.record(cuda.default_stream(1))
    b.record(side)
    assert _elapsed_ns(a, b) is None


def test_a_failing_step_wall_costs_one_step_not_the_agent(cuda, monkeypatch) -> None:
    from cuda_double import EventDouble

    errors: list = []
    rec, out = agent(errors)
    model, opt = gpu_model(cuda)
    for _ in range(3):
        one_step(model, opt)
    real = EventDouble.elapsed_time
    failures = [1]
    target = rec.prev_end  # the next step's wall runs from it

    def flaky(self, end):
        if failures and self is target:
            failures.pop()
            raise RuntimeError("CUDA error: invalid resource handle")
        return real(self, end)

    monkeypatch.setattr(EventDouble, "elapsed_time", flaky)
    for _ in range(5):
        one_step(model, opt)
    rec.flush()
    assert errors == [] and hooks._rec is rec  # still on
    assert not failures and rec.timing_faults == 1
    assert [r[0] for r in out] == list(range(8))
    assert out[-1][3][FORWARD] is not None


# --- finding 4: threads ---------------------------------------------------------------


class SlowDataset(Dataset):
    """A dataset that is the bottleneck: 4 ms a sample."""

    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        time.sleep(0.004)
        return torch.randn(8), i


def test_a_background_prefetch_thread_leaves_the_training_threads_phases_timed() -> None:
    """The CPU held-out case: batches from a background prefetch thread. Every step's
    forward, backward and optimizer are timed (nothing forced), and the time the training
    thread waited for the loader is its input time."""
    errors: list = []
    out: deque = deque()
    rec = Recorder(out)
    hooks.install(rec, torch, errors.append, None)
    try:
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        loader = DataLoader(SlowDataset(), batch_size=4)
        batches = background_batches(loader)
        for _ in range(25):
            one_step(model, opt, next(batches)[0])
    finally:
        hooks.uninstall()
    assert errors == []
    assert sum(rec.forced) == 0
    assert rec.batches >= 25
    steps = list(out)[2:]
    for _, _, _, phases in steps:
        assert all(phases[i] is not None for i in (FORWARD, BACKWARD, OPTIMIZER)), phases
    waited = sorted(p[DATALOADER] or 0 for _, _, _, p in steps)
    walls = sorted(w for _, _, w, _ in steps)
    # The loader (16 ms a batch of sleeps) is the bottleneck: most of each step is input
    # wait (the model's own work is well under a millisecond; 0.4 leaves room for a
    # starved CI machine).
    assert waited[len(waited) // 2] > 0.4 * walls[len(walls) // 2], (waited, walls)


def test_autograds_device_thread_runs_the_sync_split_and_other_threads_pass(
        cuda, monkeypatch) -> None:
    """On a GPU the gradient hooks and the final callback run on autograd's device thread
    while the training thread waits in backward: they still split backward and sync. A
    module called on another thread (an EMA copy evaluated beside training) is not
    timed on the training thread's stack."""
    backward_on_device_thread(monkeypatch)
    errors: list = []
    rec, out = agent(errors)
    model, opt = gpu_model(cuda)
    stop = threading.Event()

    def beside() -> None:
        with torch.no_grad():
            while not stop.is_set():
                model(torch.randn(2, 8))
                time.sleep(0.001)

    other = threading.Thread(target=beside, name="ema")
    for _ in range(3):
        one_step(model, opt)
    other.start()  # started after the training thread is known
    try:
        for _ in range(30):
            one_step(model, opt)
    finally:
        stop.set()
        other.join()
    rec.flush()
    assert errors == [] and sum(rec.forced) == 0
    threads = {c.thread for c in cuda.agent_calls()}
    assert threads <= {"MainThread", AUTOGRAD_THREAD}, threads
    assert AUTOGRAD_THREAD in threads  # the final callback's event
    last = list(out)[-5:]
    for _, _, _, phases in last:
        assert phases[BACKWARD] is not None and phases[SYNC] is not None, phases


# --- finding 5: offloaded parameters ----------------------------------------------------


def test_parameters_offloaded_to_the_host_are_timed_on_the_current_device(cuda) -> None:
    """FSDP CPUOffload / ZeRO-Infinity: CUDA is in use, no parameter is on it."""
    errors: list = []
    rec, out = agent(errors)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))  # on the host
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cuda.script_uses(1)
    cuda.set_device(1)
    for _ in range(6):
        one_step(model, opt)
    assert errors == []
    assert type(rec) is CudaRecorder and rec.device == 1
    assert rec.device_rule == "current device (parameters on CPU: offload)"
    assert {c.device for c in cuda.agent_calls() if c.api == "Event.record"} == {1}


def test_offloaded_parameters_are_timed_on_the_device_the_batch_moved_to(
        cuda, monkeypatch) -> None:
    on_cuda0 = type(on_device(nn.Linear(1, 1), 0).weight)
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):  # x.to("cuda:0"): a tensor that reports cuda:0
        if args and args[0] == "cuda:0":
            return on_cuda0(real_to(self, torch.float32), requires_grad=False)
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)  # before the agent's h2d wrapper
    errors: list = []
    rec, _ = agent(errors)
    model = nn.Linear(8, 1)  # parameters on the host
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cuda.script_uses(0)
    cuda.set_device(1)  # the current device is not where the batches go
    for _ in range(4):
        one_step(model, opt, torch.randn(4, 8).to("cuda:0"))
    assert errors == []
    assert rec.device == 0
    assert rec.device_rule == "first CUDA tensor (parameters on CPU: offload)"


def test_parameters_on_the_device_say_so(cuda) -> None:
    errors: list = []
    rec, _ = agent(errors)
    model, opt = gpu_model(cuda)
    one_step(model, opt)
    assert rec.device == 1 and rec.device_rule == "parameters"


# --- finding 7: bounds ------------------------------------------------------------------


def test_backward_pairs_are_bounded_and_the_event_pool_shrinks_after_a_burst(
        cuda, monkeypatch) -> None:
    monkeypatch.setattr(recorder, "MAX_STEP_PAIRS", 16)
    cuda.script_uses(1)
    rec = CudaRecorder(deque(), torch, device=1)
    for _ in range(200):  # backward after backward, no optimizer step (no boundary)
        rec.begin_backward("bw")
        rec.grads_ready()
        rec.t_ready = rec.t_mark + 1
        rec.end_backward("bw")
        assert len(rec.pairs) <= 16
    monkeypatch.setattr(recorder, "MAX_STEP_PAIRS", 4096)
    for _ in range(1000):  # an evaluation pass: thousands of events in one step
        rec.begin(FORWARD, "f")
        rec.end("f")
    rec.close_step()
    for _ in range(5):
        rec.begin(FORWARD, "f")
        rec.end("f")
        rec.close_step()
    rec.flush()
    assert len(rec.pool) <= recorder.MAX_POOL


# --- the agent's parts of finding 9 ---------------------------------------------------------


def test_the_first_device_timed_step_is_on_the_device_clock_throughout(
        cuda, monkeypatch) -> None:
    """Host clock 100 ms a phase, device clock 1 ms: a step timed on the device must not
    carry a host wall around device phases."""
    clock = SimpleNamespace(host=1, device=1)
    monkeypatch.setattr(recorder, "perf_counter_ns", lambda: clock.host)
    cuda.device_clock = lambda: clock.device
    out: deque = deque()
    rec = LazyCudaRecorder(out, torch)
    rec.device_sources.append(on_device(nn.Linear(2, 2), 1))
    cuda.script_uses(1)
    for _ in range(4):
        for idx in (FORWARD, BACKWARD, OPTIMIZER):
            rec.begin(idx, idx)
            clock.host += 100 * MS
            clock.device += 1 * MS
            rec.end(idx)
        rec.close_step()
    rec.flush()
    assert type(rec) is CudaRecorder
    for step, _, wall, phases in out:
        if phases[FORWARD] is not None and step > 0:
            assert wall <= 5 * MS, (step, wall, phases)
    assert [r[0] for r in out][-3:] == [1, 2, 3]


def test_a_step_the_grad_scaler_skips_still_closes(cuda) -> None:
    """AMP: scaler.step() skips optimizer.step() when gradients overflowed; the skipped
    step must not merge into the next one."""
    errors: list = []
    out: deque = deque()
    rec = Recorder(out)
    hooks.install(rec, torch, errors.append, None)
    try:
        model = nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
        for i in range(10):
            loss = model(torch.randn(4, 8)).sum()
            if i % 3 == 1:
                loss = loss * float("inf")  # overflow: this step is skipped
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    finally:
        hooks.uninstall()
    assert errors == []
    assert [r[0] for r in out] == list(range(10))


def test_a_sticky_cuda_error_of_the_job_is_reported_as_the_jobs(cuda, monkeypatch,
                                                                 capsys) -> None:
    monkeypatch.setitem(traceml_agent._state, "error_reported", False)
    sender = SimpleNamespace(agent_off=None)
    monkeypatch.setitem(traceml_agent._state, "sender", sender)
    rec, _ = agent([])
    hooks._on_error = traceml_agent._on_internal_error
    model, opt = gpu_model(cuda)
    for _ in range(3):
        one_step(model, opt)
    cuda.sticky_error = "device-side assert triggered"  # the job's kernel asserted
    one_step(model, opt)  # the agent's next query is the first to hear of it
    err = capsys.readouterr().err
    assert "internal error" not in err and "internal error" not in sender.agent_off
    assert "device-side assert" in sender.agent_off and "job" in sender.agent_off
    assert "device-side assert" in err


def test_the_heartbeat_hears_that_a_deep_trace_is_stopping(tmp_path, monkeypatch) -> None:
    seen: list = []
    rec = Recorder(deque())

    class Prof:
        def start(self) -> None:
            pass

        def stop(self) -> None:
            seen.append(rec.agent_busy)

        def export_chrome_trace(self, path: str) -> None:
            with open(path, "w") as f:
                f.write("{}")

    monkeypatch.setattr(torch.profiler, "profile", lambda activities=None: Prof())
    capturer = Capturer(0, str(tmp_path), torch, rec)
    assert capturer.request(1, 1)
    rec.step_listener = capturer.on_step_end
    for _ in range(3):
        rec.close_step()
    assert seen == ["deep trace stopping"]
    assert rec.agent_busy is None
