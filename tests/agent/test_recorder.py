"""The phase model on a fake clock: nesting, exclusive time, forced closes, the sync split.

Each case is the order in which real frameworks call the hooks (Lightning's closure,
manual optimization, an all-gather between phases), replayed with chosen timestamps,
so the exact milliseconds each phase must get are known.
"""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import pytest

from cuda_double import CudaDouble
from traceml_agent import recorder as rmod
from traceml_agent.recorder import (
    BACKWARD,
    DATALOADER,
    FORWARD,
    H2D,
    MEASURED,
    OPTIMIZER,
    SYNC,
    CudaRecorder,
    Recorder,
)

MS = 1_000_000


class Clock:
    def __init__(self) -> None:
        self.t = 1_000 * MS

    def __call__(self) -> int:
        return self.t

    def at(self, ms: float) -> None:
        self.t = 1_000 * MS + int(ms * MS)


def cuda_torch(clock: Clock) -> SimpleNamespace:
    """`torch` with the CUDA double (cuda_double.py), whose device clock is `clock`."""
    return SimpleNamespace(cuda=CudaDouble(device_clock=clock))


@pytest.fixture(params=["host", "cuda"])
def rig(request, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(rmod, "perf_counter_ns", clock)
    out: deque = deque()
    if request.param == "host":
        return Recorder(out), clock, out
    rec = CudaRecorder(out, cuda_torch(clock), device=0)
    return rec, clock, out


def phases(record: tuple) -> dict[str, float | None]:
    return {name: None if v is None else v / MS
            for name, v in zip(MEASURED, record[3], strict=True)}


def step_ms(record: tuple) -> float:
    return record[2] / MS


OPT, OWNER_FWD, OWNER_BWD = object(), object(), object()


def test_lightning_closure_forward_and_backward_inside_the_optimizer(rig):
    rec, clock, out = rig
    clock.at(0)
    rec.begin(DATALOADER, "it")
    clock.at(2)
    rec.end("it")
    rec.begin(OPTIMIZER, OPT)              # optimizer.step(closure) starts
    clock.at(3)
    rec.begin(FORWARD, OWNER_FWD)          # the closure: training_step
    clock.at(10)
    rec.end(OWNER_FWD)
    rec.begin_backward(OWNER_BWD)
    clock.at(14)
    rec.grads_ready()                      # DDP's allreduce wait starts
    clock.at(20)
    rec.end_backward(OWNER_BWD)
    clock.at(21.5)                         # the parameter update itself
    rec.end(OPT)
    rec.close_step()
    (record,) = out
    assert phases(record) == {"dataloader": 2.0, "h2d": None, "forward": 7.0,
                              "backward": 4.0, "sync": 6.0, "optimizer": 2.5}
    assert step_ms(record) == 21.5


def test_manual_optimization_steps_inside_forward_and_forward_goes_on(rig):
    rec, clock, out = rig
    clock.at(0)
    rec.begin(FORWARD, OWNER_FWD)          # DDP forward -> training_step
    clock.at(5)
    rec.begin_backward(OWNER_BWD)          # manual_backward
    clock.at(9)
    rec.end_backward(OWNER_BWD)
    rec.begin(OPTIMIZER, OPT)              # opt.step()
    clock.at(10)
    rec.end(OPT)
    rec.close_step()                       # the step closes inside forward
    clock.at(12)
    rec.end(OWNER_FWD)                     # training_step returns
    clock.at(13)
    rec.begin(FORWARD, OWNER_FWD)
    clock.at(18)
    rec.begin(OPTIMIZER, OPT)
    clock.at(19)
    rec.end(OPT)
    rec.close_step()
    first, second = out
    assert phases(first)["forward"] == 5.0 and phases(first)["optimizer"] == 1.0
    assert phases(first)["backward"] == 4.0
    assert phases(second)["forward"] == 2.0 + 5.0  # the tail of the first, the next one
    assert rec.forced == [0] * len(MEASURED)


def test_a_phase_whose_end_never_comes_is_closed_at_the_next_boundary_and_counted(rig):
    rec, clock, out = rig
    clock.at(0)
    rec.begin(FORWARD, OWNER_FWD)          # its end hook was lost
    clock.at(4)
    rec.begin(OPTIMIZER, OPT)
    clock.at(5)
    rec.end(OPT)
    rec.close_step()                       # one boundary: may still be a real phase
    assert rec.active == FORWARD
    clock.at(8)
    rec.begin(OPTIMIZER, OPT)
    clock.at(9)
    rec.end(OPT)
    rec.close_step()                       # a second one: it was never going to close
    assert rec.forced[FORWARD] == 1 and not rec.stack
    clock.at(10)
    rec.begin(DATALOADER, "it")            # and every phase is timed again
    clock.at(11)
    rec.end("it")
    rec.begin(OPTIMIZER, OPT)
    clock.at(12)
    rec.end(OPT)
    rec.close_step()
    assert phases(out[2]) == {"dataloader": 1.0, "h2d": None, "forward": None,
                              "backward": None, "sync": None, "optimizer": 1.0}


def test_ending_an_outer_phase_closes_what_was_left_open_inside_it(rig):
    rec, clock, out = rig
    clock.at(0)
    rec.begin(OPTIMIZER, OPT)
    clock.at(1)
    rec.begin(FORWARD, OWNER_FWD)          # never ended
    clock.at(4)
    rec.end(OPT)
    rec.close_step()
    assert phases(out[0])["forward"] == 3.0 and phases(out[0])["optimizer"] == 1.0
    assert rec.forced[FORWARD] == 1 and not rec.stack


def test_the_dataloader_is_opaque_and_a_phase_does_not_nest_in_itself(rig):
    rec, clock, out = rig
    clock.at(0)
    assert rec.begin(DATALOADER, "it")
    assert not rec.begin(FORWARD, OWNER_FWD)   # a module in a collate_fn is input work
    assert not rec.begin(SYNC, "allgather")
    clock.at(3)
    rec.end("it")
    assert rec.begin(FORWARD, OWNER_FWD)
    assert not rec.begin(FORWARD, "submodule")
    clock.at(5)
    rec.end(OWNER_FWD)
    rec.begin(OPTIMIZER, OPT)
    rec.end(OPT)
    rec.close_step()
    assert phases(out[0])["dataloader"] == 3.0 and phases(out[0])["forward"] == 2.0


def test_a_collective_between_phases_is_sync_not_wait(rig):
    rec, clock, out = rig
    clock.at(0)
    rec.begin(FORWARD, OWNER_FWD)
    clock.at(5)
    rec.end(OWNER_FWD)
    rec.begin(SYNC, "all_gather")          # HF Trainer's token count, a logged loss
    clock.at(9)
    rec.end("all_gather")
    rec.begin(OPTIMIZER, OPT)
    clock.at(10)
    rec.end(OPT)
    rec.close_step()
    assert phases(out[0])["sync"] == 4.0
    assert step_ms(out[0]) == 10.0


def test_cancel_gives_the_time_back_to_the_phase_around_it(rig):
    rec, clock, out = rig
    clock.at(0)
    rec.begin(H2D, "tensor")
    clock.at(1)
    rec.cancel()                           # a dtype cast, not a copy
    assert rec.active == -1
    rec.begin(FORWARD, OWNER_FWD)
    clock.at(2)
    rec.begin(SYNC, "c")
    clock.at(3)
    rec.cancel()
    clock.at(4)
    rec.end(OWNER_FWD)
    rec.begin(OPTIMIZER, OPT)
    rec.end(OPT)
    rec.close_step()
    assert phases(out[0])["h2d"] is None and phases(out[0])["sync"] is None
    assert phases(out[0])["forward"] == 4.0 - 1.0


def test_the_stack_is_bounded_whatever_the_hooks_do(rig):
    rec, clock, out = rig
    for i in range(rmod.MAX_DEPTH * 3):
        rec.begin(FORWARD if i % 2 else SYNC, object())
    assert len(rec.stack) <= rmod.MAX_DEPTH


def test_flush_on_a_stuck_device_returns_within_its_deadline():
    """At shutdown the rank must exit even if the device never finishes (the hang this
    tool diagnoses): flush polls with a deadline instead of synchronizing."""
    import time

    torch_double = cuda_torch(Clock())
    torch_double.cuda.stuck = True
    rec = CudaRecorder(deque(), torch_double, device=0)
    rec.begin(FORWARD, OWNER_FWD)
    rec.end(OWNER_FWD)
    rec.close_step()
    assert rec.pending
    t0 = time.monotonic()
    rec.flush(deadline_s=0.5)
    assert time.monotonic() - t0 < 1.5
    assert not any(c.api == "Event.synchronize" for c in torch_double.cuda.calls)


def test_forwards_without_optimizer_steps_keep_the_cuda_recorder_bounded():
    """An evaluation loop: forward after forward, no step boundary to resolve events."""
    from traceml_agent.recorder import MAX_STEP_PAIRS

    clock = Clock()
    rec = CudaRecorder(deque(), cuda_torch(clock), device=0)
    for _ in range(10_000):
        rec.begin(FORWARD, OWNER_FWD)
        rec.end(OWNER_FWD)
        rec.begin(BACKWARD, OWNER_BWD)  # e.g. a hook between the forwards
        rec.end(OWNER_BWD)
    assert len(rec.pairs) <= MAX_STEP_PAIRS
    assert rec.dropped_pairs > 0


def test_nothing_is_recorded_while_a_cuda_graph_is_captured():
    """torch.compile(mode="reduce-overhead") and torch.cuda.graphs capture the user's
    forward/backward: recording an event then would raise into the step. Those segments
    go untimed (None, reported as not seen), nothing raises, and steps keep their order."""
    clock = Clock()
    torch_double = cuda_torch(clock)
    cuda = torch_double.cuda
    out: deque = deque()
    rec = CudaRecorder(out, torch_double, device=0)
    for step in range(4):
        cuda.capturing = 0 if step in (1, 2) else None  # steps 1-2: inside a graph capture
        clock.at(step * 100.0)
        rec.begin(FORWARD, OWNER_FWD)
        clock.at(step * 100.0 + 30.0)
        rec.end(OWNER_FWD)
        rec.begin_backward(OWNER_BWD)
        clock.at(step * 100.0 + 80.0)
        rec.end_backward(OWNER_BWD)
        rec.close_step()
    rec.flush(deadline_s=0.1)
    assert [r[0] for r in out] == [0, 1, 2, 3]
    assert phases(out[0])["forward"] == 30.0 and phases(out[3])["forward"] == 30.0
    assert phases(out[1])["forward"] is None and phases(out[2])["backward"] is None
    assert rec.capture_skips > 0
