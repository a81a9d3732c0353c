"""What the agent must never do to the process it lives in (the CUDA rules, checked with
doubles on CPU). Forked children (DataLoader workers): inherited hooks pass straight
through. On CUDA any recorder call in a forked child would touch CUDA, which raises
"Cannot re-initialize CUDA in forked subprocess"; the recorder double here does the
same, and logs every call's pid to a file, so the test sees calls from any process."""

from __future__ import annotations

import os
import sys
from collections import deque
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import traceml_agent
from traceml_agent import hooks
from traceml_agent.recorder import Recorder


class ForkAwareRecorder(Recorder):
    """A host recorder that fails in a forked child as a CUDA recorder would."""

    __slots__ = ("log", "parent")

    def __init__(self, out: deque, log: Path) -> None:
        super().__init__(out)
        self.log, self.parent = log, os.getpid()

    def begin(self, idx: int, owner: object = None) -> bool:
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()}\n")
        if os.getpid() != self.parent:
            raise RuntimeError("Cannot re-initialize CUDA in forked subprocess. To use CUDA "
                               "with multiprocessing, you must use the 'spawn' start method")
        return super().begin(idx, owner)


class CastingDataset(Dataset):
    """A dataset whose items are cast, and a module used in preprocessing (both common)."""

    def __init__(self) -> None:
        self.norm = nn.LayerNorm(8)

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x = torch.randn(8).to(torch.float16).to(torch.float32)
        return self.norm(x).detach(), i % 2


def test_forked_dataloader_workers_never_call_the_recorder(tmp_path: Path, capfd) -> None:
    log = tmp_path / "calls"
    rec = ForkAwareRecorder(deque(maxlen=1000), log)
    errors: list[BaseException] = []
    hooks.install(rec, torch, errors.append, None)
    try:
        model = nn.Linear(8, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(CastingDataset(), batch_size=8, num_workers=2,
                            multiprocessing_context="fork")
        for _ in range(2):  # workers forked after the roots were learned, too
            for x, y in loader:
                loss = nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
    finally:
        hooks.uninstall()
    pids = {int(line) for line in log.read_text().split()}
    assert pids == {os.getpid()}, f"recorder called from forked children: {pids - {os.getpid()}}"
    assert not errors
    assert rec.step == 16
    assert "traceml" not in capfd.readouterr().err


def test_the_agent_is_inert_in_a_forked_child_process() -> None:
    """A user's own os.fork(): the child's agent is off and its hooks do nothing."""
    traceml_agent._state["rec"] = object()  # as if running in the parent
    try:
        pid = os.fork()
        if pid == 0:
            ok = not traceml_agent.enabled() and hooks._rec is None
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        traceml_agent._state["rec"] = None


if sys.platform != "linux":  # pragma: no cover
    import pytest

    pytestmark = pytest.mark.skip("fork is the Linux default this is about")


def test_the_gpu_checksum_is_polled_on_the_training_thread_only() -> None:
    """The weights' checksum is copied behind a CUDA event; the sender thread (which
    builds the facts message) must never query it: a CUDA call from another thread makes
    a context on GPU 0 and breaks a CUDA graph being captured on the training thread."""
    import threading

    from traceml_agent.checks import StepObserver, _PendingChecksum

    queried_on: list[int] = []

    class Event:
        def query(self) -> bool:
            queried_on.append(threading.get_ident())
            return len(queried_on) >= 2  # completes at the second look

    obs = StepObserver(0, 1)
    obs.watch_model(nn.Linear(4, 2))
    pending = _PendingChecksum.__new__(_PendingChecksum)
    pending.value, pending.host, pending.event = None, torch.tensor(5.0), Event()
    obs._checksums = obs._in_flight = [pending]  # as on GPU: a copy in flight

    facts: list = []
    sender = threading.Thread(target=lambda: facts.append(obs.take_facts()))
    obs.on_optimizer_step()  # first look: still in flight
    sender.start(), sender.join()
    assert facts == [None]  # not ready, and the sender did not look
    obs.on_optimizer_step()  # second look: done
    sender = threading.Thread(target=lambda: facts.append(obs.take_facts()))
    sender.start(), sender.join()
    assert facts[1]["param_checksum"] == 5.0
    assert set(queried_on) == {threading.get_ident()}
