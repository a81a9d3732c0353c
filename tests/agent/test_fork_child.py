"""Issue 40, item 8: a forked child (a DataLoader worker) must not free what the parent's
agent holds. On CUDA the setup observer keeps the weights' checksum in a pinned host
buffer and the recorder keeps CUDA events; freeing either in a forked child is a CUDA
call there, and CUDA answers it with std::terminate (the worker aborts). The child's
agent goes inert (agent/__init__.py, `_inert_in_child`): it must keep the parent's
objects referenced, never drop them. Here the buffer and the recorder carry finalizers
that abort the process, as CUDA does, when they run in a process that did not make
them; the parent's sender thread has already ended (its Sender holds the observer)."""

from __future__ import annotations

import gc
import os
import sys
import weakref
from collections import deque
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import traceml_agent
from traceml_agent import hooks
from traceml_agent.checks import StepObserver, _PendingChecksum
from traceml_agent.recorder import Recorder

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="fork is the Linux default")


class EventHoldingRecorder(Recorder):
    """A recorder whose end can be watched (the CUDA recorder's events go with it)."""

    __slots__ = ("__weakref__",)


def _abort_unless(pid: int) -> None:
    """cudaFreeHost / cudaEventDestroy in a forked child: CUDA terminates the process."""
    if os.getpid() != pid:
        os.abort()


def test_a_forked_child_frees_nothing_of_the_parents_agent() -> None:
    parent = os.getpid()
    rec = EventHoldingRecorder(deque())
    weakref.finalize(rec, _abort_unless, parent)
    obs = StepObserver(0, 1)
    obs.watch_model(nn.Linear(4, 2))
    pinned = torch.tensor(5.0)  # the checksum's pinned buffer, as on a GPU
    weakref.finalize(pinned, _abort_unless, parent)
    pending = _PendingChecksum.__new__(_PendingChecksum)
    pending.value, pending.host, pending.event = 5.0, pinned, None
    obs._checksums = [pending]
    del pinned, pending
    errors: list[BaseException] = []
    hooks.install(rec, torch, errors.append, obs)
    # As in a rank whose sender thread has ended: only the agent's state holds them.
    traceml_agent._state["rec"] = rec
    traceml_agent._state["sender"] = SimpleNamespace(observer=obs, rec=rec)
    del rec, obs
    try:
        pid = os.fork()
        if pid == 0:  # the child: its agent inert, nothing of the parent's freed
            gc.collect()
            ok = not traceml_agent.enabled() and hooks._rec is None and hooks._obs is None
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, (
            f"the forked child exited with {os.waitstatus_to_exitcode(status)} "
            "(-6: it freed the parent's pinned buffer or recorder, which aborts on CUDA)")
    finally:
        hooks.uninstall()
        traceml_agent._state["rec"] = traceml_agent._state["sender"] = None
