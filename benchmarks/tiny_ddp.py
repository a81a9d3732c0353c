"""The overhead benchmark's workload: a tiny DDP model on CPU, ~1 ms per step, one rank.

Run by itself (bare), under `traceml run`, or under any other tool; it prints its
own mean step time over the timed steps, so every variant is measured the same way:

    python -m torch.distributed.run --nproc-per-node 1 benchmarks/tiny_ddp.py --steps 3000
    traceml run benchmarks/tiny_ddp.py --headless -- --steps 3000
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset


def build(batch: int = 32, dim: int = 64, ddp: bool = True):
    """The loop's parts; ddp=False leaves the model unwrapped (no process group needed)."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(batch * 256, dim), torch.randint(0, 10, (batch * 256,)))
    loader = DataLoader(data, batch_size=batch, shuffle=True, drop_last=True)
    model = nn.Sequential(nn.Linear(dim, 128), nn.ReLU(), nn.Linear(128, 10))
    if ddp:
        model = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return loader, model, opt, nn.CrossEntropyLoss()


def run_steps(n: int, loader, model, opt, loss_fn) -> float:
    """Train n steps; returns the mean wall time per step in ms."""
    done = 0
    t0 = time.perf_counter()
    while done < n:
        for x, y in loader:
            loss = loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            done += 1
            if done >= n:
                break
    return (time.perf_counter() - t0) * 1000.0 / n


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--warmup", type=int, default=300)
    args = p.parse_args()
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    parts = build()
    run_steps(args.warmup, *parts)
    ms = run_steps(args.steps, *parts)
    print(json.dumps({"ms_per_step": ms, "steps": args.steps, "pid": os.getpid()}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
