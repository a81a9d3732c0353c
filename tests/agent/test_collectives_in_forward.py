"""Collectives the frameworks issue inside forward are sync, not forward compute.

DDP with broadcast_buffers=True (the default) broadcasts its buffers (BatchNorm
statistics) from rank 0 at the start of every forward. That is a collective wait: a
rank that arrives early waits there for rank 0, and counting it as forward blames the
wrong rank for "compute". Here the broadcast is made slow on purpose (one-rank gloo
group, the real DDP, the real hooks) and must land in sync, with forward keeping only
the module's own work.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from agent_installed import installed
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from traceml_agent.recorder import FORWARD, MEASURED, SYNC

BROADCAST_MS = 100.0  # far above a tiny forward even on a starved 2-core box (47 ms seen)


@pytest.fixture
def group(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.alone  # the forward's own time against a 100 ms broadcast, measured
def test_ddps_buffer_broadcast_inside_forward_is_sync(group, monkeypatch):
    real = dist._broadcast_coalesced
    spent: list[float] = []  # each broadcast's own wall time, as DDP's forward saw it

    def slow_broadcast(*args, **kwargs):
        t0 = time.perf_counter()
        time.sleep(BROADCAST_MS / 1e3)
        try:
            return real(*args, **kwargs)
        finally:
            spent.append((time.perf_counter() - t0) * 1e3)

    monkeypatch.setattr(dist, "_broadcast_coalesced", slow_broadcast)
    model = DDP(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with installed() as (_, errors, out):
        for _ in range(6):
            model(torch.randn(16, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert errors == []
    # DDP's construction broadcasts once (before the agent here), then every forward.
    assert len(out) == 6 and len(spent) == 7
    for record, broadcast_ms in list(zip(out, spent[1:], strict=True))[2:]:  # roots learned by then
        ns = dict(zip(MEASURED, record[3], strict=True))
        forward, sync = ns[MEASURED[FORWARD]], ns[MEASURED[SYNC]]
        assert forward is not None and sync is not None, ns
        # The broadcast's whole time is sync, none of it forward. Sync also holds DDP's
        # one-rank gradient allreduce (well under a millisecond idle, a few under load),
        # so it is bounded by half the broadcast again, not by a fixed 2 ms. Forward
        # would hold the whole sleep if the broadcast were counted there; its own work is
        # under a millisecond idle and well under the broadcast on a starved VM (47 ms).
        assert broadcast_ms - 0.5 <= sync / 1e6 < 1.5 * broadcast_ms, (ns, broadcast_ms)
        assert forward / 1e6 < broadcast_ms, (ns, broadcast_ms)
