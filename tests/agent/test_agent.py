"""The agent in-process, against a real ZeroMQ socket standing in for the collector."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import zmq
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import traceml_agent
from traceml_agent import hooks, protocol


@pytest.fixture
def collector():
    """A ROUTER socket on loopback; yields (endpoint, receive_all)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    received: list[protocol.Message] = []

    def receive_all(until_kind: str = "goodbye", timeout: float = 10.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sock.poll(100):
                _, payload = sock.recv_multipart()
                received.append(protocol.decode(payload))
                if received[-1].kind == until_kind:
                    break
        return received

    yield f"tcp://127.0.0.1:{port}", receive_all
    traceml_agent.shutdown()
    sock.close(0)


def _train(steps: int, accumulate: int = 1) -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 8), torch.randint(0, 2, (256,)))
    loader = iter(DataLoader(data, batch_size=4))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        for _ in range(accumulate):
            x, y = next(loader)
            nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _records(messages):
    steps = [m for m in messages if m.kind == "steps"]
    return steps[0].phases if steps else (), [r for m in steps for r in m.records]


def test_gradient_accumulation_counts_one_step_per_optimizer_update(collector):
    endpoint, receive_all = collector
    assert traceml_agent.init(endpoint=endpoint)
    _train(steps=6, accumulate=4)
    traceml_agent.shutdown(exit_code=0)
    phases, records = _records(receive_all())
    assert [r.step for r in records] == list(range(6))
    col = {name: i for i, name in enumerate(phases)}
    for r in records[1:]:
        for name in ("dataloader", "forward", "backward", "optimizer", "wait"):
            assert r.phase_ms[col[name]] is not None and r.phase_ms[col[name]] >= 0, name
        assert r.phase_ms[col["h2d"]] is None  # no host-to-device copy on a CPU job
        measured = sum(v for v in r.phase_ms if v is not None)
        assert measured == pytest.approx(r.step_ms, rel=1e-6, abs=1e-3)


def test_hello_heartbeat_and_goodbye_carry_identity_and_exit_code(collector):
    endpoint, receive_all = collector
    traceml_agent.init(endpoint=endpoint, run_name="unit")
    _train(steps=3)
    time.sleep(1.2)  # one sys/heartbeat period
    traceml_agent.shutdown(exit_code=7, error="boom")
    messages = receive_all()
    kinds = [m.kind for m in messages]
    assert kinds[0] == "hello" and kinds[-1] == "goodbye"
    assert {"sys", "heartbeat"} <= set(kinds)
    assert messages[0].body.run == "unit"
    bye = messages[-1].body
    assert (bye.exit_code, bye.error, bye.steps) == (7, "boom", 3)
    assert len({m.ident for m in messages}) == 1
    assert [m.seq for m in messages] == sorted(m.seq for m in messages)


def _step_for(model: nn.Module, opt: torch.optim.Optimizer, t0: float, seconds: float) -> int:
    """Steps of ~0.1 s until `seconds` after `t0`; how many."""
    steps = 0
    while time.monotonic() - t0 < seconds:
        nn.functional.cross_entropy(model(torch.randn(4, 8)), torch.tensor([0, 1, 0, 1])
                                    ).backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.1)
        steps += 1
    return steps


def test_a_rank_of_a_huge_job_sends_less_often_but_loses_nothing(collector, monkeypatch):
    """At 16,384 ranks a rank batches its steps once a second and samples the system every
    5 s (agent/transport.py), so that node 0 can read them all; while its batches flow its
    heartbeat comes every 5 s too."""
    endpoint, receive_all = collector
    monkeypatch.setenv("WORLD_SIZE", "16384")
    t0 = time.monotonic()  # the sender's clock starts at init (~1 s on a busy machine)
    traceml_agent.init(endpoint=endpoint)
    model = nn.Linear(8, 2)
    steps = _step_for(model, torch.optim.SGD(model.parameters(), lr=0.1), t0, 3.5)
    traceml_agent.shutdown(exit_code=0)
    elapsed = time.monotonic() - t0
    messages = receive_all()
    count = {k: sum(1 for m in messages if m.kind == k) for k in ("steps", "sys", "heartbeat")}
    assert count["steps"] <= elapsed + 2, count  # one a second (+ the final flush); 10 before
    # The start's sample and the exit's (its last interval, FINAL_SYS_MIN_S); none between.
    assert count["sys"] == 2, count
    if os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat"):
        # The exit's sample carries the training thread's shares since it was first known:
        # without it a job shorter than two samples has no CPU wait at all.
        last = [m.body for m in messages if m.kind == "sys"][-1]
        assert last.thread_cpu_pct is not None and last.cpu_wait_pct is not None, last
        # ... and nothing else: memory at exit is the teardown's, not the training's.
        assert last.at_exit and last.rss_mb is None and last.cpu_pct is None, last
    # The start's and the exit's (4-5 before: one a second).
    assert count["heartbeat"] <= 3, (count, elapsed)
    assert [r.step for r in _records(messages)[1]] == list(range(steps))


def test_a_rank_of_a_huge_job_that_stops_stepping_beats_every_second(collector, monkeypatch):
    """The near miss of the 5 s heartbeat: once a rank's batches stop (a stall, a hang),
    its heartbeats come every second again, so its phase and stacks reach the hang
    detector as fast as in a small job and it is never silent for its 5 s."""
    endpoint, receive_all = collector
    monkeypatch.setenv("WORLD_SIZE", "16384")
    t0 = time.monotonic()
    traceml_agent.init(endpoint=endpoint)
    model = nn.Linear(8, 2)
    _step_for(model, torch.optim.SGD(model.parameters(), lr=0.1), t0, 1.5)
    stopped = time.time()
    time.sleep(3.5)  # no step closes
    traceml_agent.shutdown(exit_code=0)
    beats = [m.t for m in receive_all() if m.kind == "heartbeat"][:-1]  # less the exit's
    # Its last batch goes out within a second of the stop; then a beat every second.
    after = [t for t in beats if t > stopped]
    assert len(after) >= 2, (beats, stopped)
    assert max(b - a for a, b in zip([stopped, *after], after, strict=False)) < 2.6, beats


def test_a_missing_collector_costs_nothing_but_the_data():
    # Nothing listens on this port: sends queue up and are dropped, training goes on.
    assert traceml_agent.init(endpoint="tcp://127.0.0.1:9")
    t0 = time.monotonic()
    _train(steps=50)
    traceml_agent.shutdown()
    assert time.monotonic() - t0 < 10


def test_internal_error_turns_the_agent_off_once_and_training_continues(collector, monkeypatch):
    endpoint, _ = collector
    original_backward = torch.autograd.backward
    traceml_agent.init(endpoint=endpoint)
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)

    def broken(self, *args):
        raise RuntimeError("agent bug")

    for name in ("close_step", "end_step"):  # end_step: the step close written out
        monkeypatch.setattr(type(traceml_agent._state["rec"]), name, broken)
    _train(steps=5)  # must not raise
    assert not traceml_agent.enabled()
    assert torch.autograd.backward is original_backward  # hooks uninstalled
    assert stderr.getvalue().count("[traceml]") == 1


def test_uninstall_restores_everything_it_patched(collector):
    from torch.utils.data import dataloader as dl

    endpoint, _ = collector
    before = (dl._BaseDataLoaderIter.__next__, torch.autograd.backward,
              nn.Sequential.__dict__.get("__call__"), nn.Module.__call__)
    traceml_agent.init(endpoint=endpoint)
    assert nn.Module.__call__ is not before[3]  # learning the roots
    _train(steps=2)  # learns nn.Sequential as a root and wraps its __call__
    assert nn.Sequential.__call__ is not before[3]
    assert nn.Module.__call__ is before[3]  # learning over: every other module is untouched
    traceml_agent.shutdown()
    after = (dl._BaseDataLoaderIter.__next__, torch.autograd.backward,
             nn.Sequential.__dict__.get("__call__"), nn.Module.__call__)
    assert after == before
    assert not hooks._undo


def test_a_saved_model_does_not_reference_the_agent(collector):
    endpoint, _ = collector
    traceml_agent.init(endpoint=endpoint)
    model = nn.Sequential(nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    buf = io.BytesIO()
    torch.save(model, buf)
    assert b"traceml" not in buf.getvalue()


def test_importing_the_agent_imports_neither_torch_nor_textual():
    code = ("import sys, traceml_agent; "
            "print(sorted(m for m in ('torch', 'textual') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_heartbeat_carries_the_recorders_progress_and_timing_counts(collector):
    """Issue 29: the batches fetched, graph replays, timing faults, capture skips, the
    device rule and a busy agent reach the collector in the heartbeat, bounded."""
    endpoint, receive_all = collector
    traceml_agent.init(endpoint=endpoint, run_name="unit")
    _train(steps=3)
    rec = traceml_agent._state["rec"]
    rec.replays, rec.timing_faults, rec.capture_skips = 12, 2, 5
    rec.device_rule, rec.agent_busy = "current device (parameters on CPU: offload)", "x" * 999
    messages = receive_all(until_kind="heartbeat", timeout=5.0)
    beat = None
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:  # a heartbeat taken after the counts were set
        beats = [m for m in messages if m.kind == "heartbeat" and m.body.replays == 12]
        if beats:
            beat = beats[-1].body
            break
        messages = receive_all(until_kind="heartbeat", timeout=2.0)
    traceml_agent.shutdown(exit_code=0)
    assert beat is not None
    assert (beat.batches, beat.replays, beat.timing_faults, beat.capture_skips) == (3, 12, 2, 5)
    assert beat.device_rule == "current device (parameters on CPU: offload)"
    assert beat.agent_busy == "x" * protocol.MAX_STR  # cut to the wire's bound


def _shares_samples(messages: list[protocol.Message]) -> list[protocol.Sys]:
    return [m.body for m in messages if m.kind == "sys" and m.body.thread_cpu_pct is not None]


@pytest.mark.skipif(not os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat"),
                    reason="this kernel keeps no scheduler statistics: no shares to qualify")
@pytest.mark.parametrize("first_step_s, steps, pause_s, stepping", [
    (2.0, 15, 0.0, "low"),  # a first step that waits 2 s (its peers starting), then 30 ms
    (0.0, 40, 0.05, "high"),  # steps back to back, 50 ms each: the near miss
], ids=["first-step-waits", "steps-back-to-back"])
def test_each_sample_says_how_much_of_its_interval_the_steps_after_warm_up_filled(
        collector, first_step_s, steps, pause_s, stepping):
    """The shares of a sample mostly spent outside the steps the diagnosis reads (step 0,
    start-up) are marked so (stepping_pct under half: judge/ingest.py does not take
    them); a rank stepping back to back fills its samples."""
    endpoint, receive_all = collector
    traceml_agent.init(endpoint=endpoint)
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        loss = nn.functional.cross_entropy(model(torch.randn(4, 8)), torch.tensor([0, 1, 0, 1]))
        time.sleep(first_step_s if step == 0 else pause_s)  # inside the step
        loss.backward()
        opt.step()
        opt.zero_grad()
    traceml_agent.shutdown(exit_code=0)
    samples = _shares_samples(receive_all())
    assert samples, "no sample with the training thread's shares"
    pcts = [s.stepping_pct for s in samples]
    assert all(p is not None for p in pcts), pcts
    if stepping == "low":
        assert all(p < 50.0 for p in pcts), pcts
    else:
        assert all(p >= 50.0 for p in pcts), pcts
