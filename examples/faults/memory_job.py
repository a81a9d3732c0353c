"""A small DDP job (CPU, gloo) whose memory does what it is told: one rank leaking a few
MB per step, every rank growing during warm-up then holding, or nothing at all.

It knows nothing about traceml: run it under `traceml run` and the agent samples its
memory (docs/diagnosis.md, "Memory growth").

    traceml run examples/faults/memory_job.py --nproc-per-node 2 -- --leak-rank 1 --leak-mb 2

  --steps N --step-s S     N steps, each paced to S seconds (the memory rule reads a
                           trend over seconds, so the run lasts N x S whatever the box)
  --leak-rank R --leak-mb M
                           rank R keeps M MB more every step (a list of tensors it never
                           lets go: the usual leak, a metric or a graph kept per step)
  --warmup-mb M --warmup-steps K
                           every rank takes M MB more on each of its first K steps, then
                           holds (caches filled during warm-up: a plateau, not a leak)
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def _hold(mb: float) -> torch.Tensor:
    """`mb` MB of memory that is really resident (written, not only reserved)."""
    return torch.ones(max(1, int(mb * 2**20 / 4)), dtype=torch.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--step-s", type=float, default=0.2)
    ap.add_argument("--leak-rank", type=int, default=None)
    ap.add_argument("--leak-mb", type=float, default=0.0)
    ap.add_argument("--warmup-mb", type=float, default=0.0)
    ap.add_argument("--warmup-steps", type=int, default=0)
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept: list[torch.Tensor] = []
    x, y = torch.randn(16, 64), torch.randn(16, 1)
    for step in range(args.steps):
        started = time.monotonic()
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == args.leak_rank and args.leak_mb > 0:
            kept.append(_hold(args.leak_mb))
        if step < args.warmup_steps and args.warmup_mb > 0:
            kept.append(_hold(args.warmup_mb))
        time.sleep(max(0.0, args.step_s - (time.monotonic() - started)))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
