"""A small FSDP2 (`fully_shard`) training script on CPU/gloo, with an injectable straggler.

    traceml run examples/fsdp_toy.py --nproc-per-node 2 -- --scenario input --rank 1

Like ddp_toy.py it knows nothing about traceml. Each Linear layer is its own FSDP
unit, so forward all-gathers parameters layer by layer and backward reduce-scatters
gradients layer by layer: the communication FSDP issues happens inside forward and
backward, and that is where traceml reports it (docs/fsdp.md).
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset

SCENARIOS = ("balanced", "input", "forward")


class RandomData(Dataset):
    def __init__(self, n: int, dim: int, slow_s: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g)
        self.slow_s = slow_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.slow_s:
            time.sleep(self.slow_s)
        return self.x[i]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenario", choices=SCENARIOS, default="balanced")
    p.add_argument("--rank", type=int, default=1, help="the rank the problem is injected on")
    p.add_argument("--delay-ms", type=float, default=20.0)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    me = rank == args.rank
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(args.dim, args.dim), nn.ReLU())
                            for _ in range(4)], nn.Linear(args.dim, 1))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    slow_item = args.delay_ms / 1000 / args.batch if me and args.scenario == "input" else 0.0
    data = RandomData(args.batch * (args.steps + 1), args.dim, slow_item)
    loader = DataLoader(data, batch_size=args.batch)
    start = time.perf_counter()
    for step, x in enumerate(loader):
        if step >= args.steps:
            break
        y = model(x)
        if me and args.scenario == "forward":
            time.sleep(args.delay_ms / 1000)  # rank-local extra work inside the step
        y.square().mean().backward()
        opt.step()
        opt.zero_grad()
    elapsed = time.perf_counter() - start
    if rank == 0:
        print(f"done: {args.steps} FSDP steps in {elapsed:.1f} s, scenario={args.scenario}, "
              f"world={world}, pid={os.getpid()}")
    dist.barrier()
    # Free what holds the process group first (a DDP or FSDP model does): else gloo's
    # context outlives destroy_process_group and goes in the interpreter's own teardown,
    # whose threads can abort the finished process (examples/mistakes/_common.close).
    del model, opt, loader
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
