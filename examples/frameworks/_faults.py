"""Injected problems for the framework examples, on a schedule of micro-batches.

Each example trains a tiny model written the way its framework's docs show. To give
the agent something to find, every rank sleeps BASE_FORWARD_MS in the model's forward
(the "compute" of a model too small to have any), and the schedule in $FAULTS adds
time on one rank for a range of micro-batches:

    FAULTS="compute:1:60:160,input:2:220:320"

    compute:R:A:B   rank R's forward takes EXTRA_MS longer for micro-batches A..B-1
    input:R:A:B     rank R's batches take INPUT_EXTRA_MS (default EXTRA_MS) longer to
                    load for A..B-1

Micro-batches are counted per rank from 0 (a forward in training mode, or a batch
fetched by the sampler), so with gradient accumulation of k there are k per
optimizer step. Each script prints OPTIMIZER_STEPS=N (its framework's own count)
on rank 0 when it ends.
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn
from torch.utils.data import Dataset

BASE_FORWARD_MS = float(os.environ.get("BASE_FORWARD_MS", "15"))
EXTRA_MS = float(os.environ.get("EXTRA_MS", "30"))
# DataLoader workers hide slow loading until it outruns them: an input fault meant to
# show through N workers needs about N times the step's own time.
INPUT_EXTRA_MS = float(os.environ.get("INPUT_EXTRA_MS", str(EXTRA_MS)))
DIM = 32


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _schedule() -> list[tuple[str, int, int, int]]:
    out = []
    for item in filter(None, os.environ.get("FAULTS", "").split(",")):
        kind, r, a, b = item.split(":")
        out.append((kind, int(r), int(a), int(b)))
    return out


SCHEDULE = _schedule()


def faulty(kind: str, micro_batch: int) -> bool:
    me = rank()
    return any(k == kind and r == me and a <= micro_batch < b for k, r, a, b in SCHEDULE)


class Work(nn.Module):
    """Stands for the model's compute: BASE_FORWARD_MS on every rank, plus EXTRA_MS on a
    rank with a compute fault. Kept out of torch.compile's graph (it sleeps)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            delay = BASE_FORWARD_MS + (EXTRA_MS if faulty("compute", self.calls) else 0.0)
            self.calls += 1
            time.sleep(delay / 1000.0)
        return x


class TinyNet(nn.Module):
    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(DIM, 64), nn.ReLU(), Work(), nn.Linear(64, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class SyntheticData(Dataset):
    """Random features and labels. Item i belongs to micro-batch i // (world * batch) on
    its rank, both for DistributedSampler(shuffle=False) and for a sequential sampler
    sharded by batches (Accelerate, HF Trainer): an input fault sleeps per item."""

    def __init__(self, n: int, batch: int, classes: int = 4) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, DIM, generator=g)
        self.y = torch.randint(0, classes, (n,), generator=g)
        self.batch = batch

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        if faulty("input", i // (world() * self.batch)):
            time.sleep(INPUT_EXTRA_MS / 1000.0 / self.batch)
        return self.x[i], self.y[i]


def report_steps(steps: int) -> None:
    if rank() == 0:
        print(f"OPTIMIZER_STEPS={steps}", flush=True)
