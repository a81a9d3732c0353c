"""Shared pieces of the mistake examples (examples/mistakes/*.py).

Each example builds its own model, sampler, loader and wrapper, so its one mistake is
in plain sight in its own file; this module holds only what they all do the same way.
Every example runs on CPU with gloo in a few seconds:

    python -m torch.distributed.run --nproc-per-node 2 examples/mistakes/clean.py

They know nothing about traceml: `traceml run examples/mistakes/X.py --nproc-per-node 2`
shows the finding the file is named after.
"""

from __future__ import annotations

import gc
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

STEPS = 30
DIM = 32
CLASSES = 4


def setup() -> tuple[int, int]:
    """gloo on CPU, one thread per rank (several ranks share a few cores)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


class RandomData(Dataset):
    """A fixed random classification set, identical on every rank."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, DIM, generator=g)
        self.y = torch.randint(0, CLASSES, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def make_model(batchnorm: bool = False, seed: int = 0) -> nn.Module:
    """A small MLP, seeded so every rank builds the same weights."""
    torch.manual_seed(seed)
    norm = [nn.BatchNorm1d(64)] if batchnorm else []
    return nn.Sequential(nn.Linear(DIM, 64), *norm, nn.ReLU(), nn.Linear(64, CLASSES))


def train(model: nn.Module, loader, steps: int = STEPS) -> None:
    """The ordinary loop: set_epoch every epoch, one backward per optimizer step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_fn = nn.CrossEntropyLoss()
    step, epoch = 0, 0
    while step < steps:
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            opt.step()
            step += 1
            if step >= steps:
                break
        epoch += 1


def finish(name: str, t0: float) -> None:
    if dist.get_rank() == 0:
        print(f"{name}: done in {time.perf_counter() - t0:.1f} s on {dist.get_world_size()} ranks")
    # Without this barrier, a rank that tears gloo down while its peer is still closing
    # aborts now and then ("terminate called without an active exception": 3 of 20 runs
    # here, 0 of 40 with it).
    dist.barrier()


def close() -> None:
    """Destroy the process group once the script's model, optimizer and loader are gone
    (call it after main() returns). A DDP model still alive holds the gloo process group,
    which destroy_process_group then cannot free: it goes in the interpreter's own
    teardown, where its threads can end the process with "terminate called without an
    active exception" after the work is done (the exit code is then 1)."""
    gc.collect()
    dist.destroy_process_group()
