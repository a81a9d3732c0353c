"""Fault jobs for a stall's advice and for no-distributed-sampler's severity (issue 39,
items 4 and 5). Each runs on CPU with gloo in a few seconds, under `traceml run`:

    traceml run examples/faults/advice_jobs.py --nproc-per-node 2 -- --scenario epoch-stall

--scenario:
  epoch-stall  DataLoader workers restarted every epoch (num_workers=2,
               persistent_workers=False) that take --seconds to start: every rank stalls
               in dataloader at each epoch start, every len(loader) steps.
  gc-pause     rank --rank holds many cyclic objects and makes more every step, so its
               full garbage collections take tens of ms, every few dozen steps.
  checkpoint   rank --rank sleeps --seconds at the step boundary every --every steps.
  shards       each rank loads its own shard from a file of its own, no
               DistributedSampler: right, not a mistake.
  shared-data  every rank reads the same batches, no DistributedSampler: the mistake.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DIM = 32


class Tensors(Dataset):
    """Samples held in memory (x, y)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def make_data(n: int, seed: int) -> Tensors:
    g = torch.Generator().manual_seed(seed)
    return Tensors(torch.randn(n, DIM, generator=g), torch.randint(0, 4, (n,), generator=g))


class Node:
    """A cyclic object: only the garbage collector frees it."""

    __slots__ = ("me", "__weakref__")

    def __init__(self) -> None:
        self.me = self


def slow_start(seconds: float):
    def init(_worker: int) -> None:
        time.sleep(seconds)  # a worker that takes long to start (imports, opening files)
    return init


def loader_for(args, rank: int, world: int) -> DataLoader:
    if args.scenario == "epoch-stall":
        data = make_data(args.batch * args.loader_len * world, 0)
        return DataLoader(data, batch_size=args.batch, sampler=DistributedSampler(data),
                          num_workers=2, persistent_workers=False,
                          worker_init_fn=slow_start(args.seconds))
    if args.scenario == "shards":
        # Each rank's own shard, written to and loaded from a file of its own (as a job
        # that pre-split its data per rank would): no sampler needed.
        path = os.path.join(tempfile.gettempdir(), f"advice_shard_{os.getpid()}.pt")
        torch.save(make_data(256, 100 + rank).x, path)
        x = torch.load(path)
        os.unlink(path)
        data = Tensors(x, torch.zeros(len(x), dtype=torch.int64))
        return DataLoader(data, batch_size=args.batch, shuffle=True, drop_last=True)
    if args.scenario == "shared-data":
        data = make_data(256, 0)  # the same on every rank, and no sampler: the mistake
        return DataLoader(data, batch_size=args.batch, shuffle=False, drop_last=True)
    data = make_data(args.batch * 64 * world, 0)
    return DataLoader(data, batch_size=args.batch, sampler=DistributedSampler(data),
                      drop_last=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--scenario", required=True,
                   choices=("epoch-stall", "gc-pause", "checkpoint", "shards", "shared-data"))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--loader-len", type=int, default=20, help="epoch-stall: batches/epoch")
    p.add_argument("--seconds", type=float, default=0.3)
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--rank", type=int, default=0, help="the rank that pauses or saves")
    p.add_argument("--objects", type=int, default=300_000, help="gc-pause: kept objects")
    p.add_argument("--per-step", type=int, default=4_000, help="gc-pause: new per step")
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(DIM, 64), nn.ReLU(), nn.Linear(64, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    loader = loader_for(args, rank, world)
    pausing = args.scenario == "gc-pause" and rank == args.rank
    kept = [Node() for _ in range(args.objects)] if pausing else []
    recent: collections.deque = collections.deque(maxlen=5 * args.per_step)
    gc.collect()

    step, epoch = 0, 0
    while step < args.steps:
        if isinstance(loader.sampler, DistributedSampler):
            loader.sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            opt.step()
            step += 1
            if pausing:  # objects that live a while, then die in a full collection
                recent.extend(Node() for _ in range(args.per_step))
            if (args.scenario == "checkpoint" and rank == args.rank
                    and step % args.every == 0):
                time.sleep(args.seconds)  # a synchronous save between steps
            if step >= args.steps:
                break
        epoch += 1
    del kept
    dist.barrier()
    if rank == 0:
        print(f"{args.scenario}: {step} steps on {world} ranks")


if __name__ == "__main__":
    main()
    gc.collect()
    dist.destroy_process_group()
