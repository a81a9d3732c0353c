"""The detection-latency benchmark's workload: a small DDP job (CPU, gloo) whose problem
starts at a known step, and which writes the moment it starts by its own clock.

examples/ddp_toy.py injects its straggler from the first step, so the moment it begins
is lost in the warm-up; here the problem starts at --from-step, after the diagnosis has
settled on BALANCED, and the injecting rank writes time.time() to --onset-file right
before the first delayed step (or before it stops forever, for a hang).

    traceml run benchmarks/latency_job.py --nproc-per-node 4 --headless -- \\
        --straggler-rank 2 --from-step 150 --onset-file /tmp/onset
    traceml run benchmarks/latency_job.py --nproc-per-node 4 --headless -- \\
        --hang-rank 1 --from-step 150 --onset-file /tmp/onset
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Net(nn.Module):
    """The model of examples/ddp_toy.py, with a switchable sleep in forward: a rank-local
    branch doing extra work (a compute straggler)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(dim, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                                  nn.Linear(512, 10))
        self.extra_s = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.extra_s:
            time.sleep(self.extra_s)
        return self.body(x)


def write_onset(path: Path | None) -> None:
    if path is not None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(f"{time.time():.6f}\n")
        os.replace(tmp, path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--from-step", type=int, default=150)
    p.add_argument("--straggler-rank", type=int, default=None)
    p.add_argument("--hang-rank", type=int, default=None)
    p.add_argument("--delay-ms", type=float, default=25.0)
    p.add_argument("--onset-file", type=Path, default=None)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--dim", type=int, default=256)
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    n = args.batch * world * 64
    data = TensorDataset(torch.randn(n, args.dim, generator=g),
                         torch.randint(0, 10, (n,), generator=g))
    loader = DataLoader(data, batch_size=args.batch, sampler=DistributedSampler(data, seed=0),
                        drop_last=True)
    torch.manual_seed(0)
    net = Net(args.dim)
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()

    step, epoch = 0, 0
    while step < args.steps:
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            if step == args.from_step:
                if rank == args.hang_rank:
                    write_onset(args.onset_file)
                    while True:  # stuck in its own code: the others wait in the allreduce
                        time.sleep(1.0)
                if rank == args.straggler_rank:
                    net.extra_s = args.delay_ms / 1000.0
                    write_onset(args.onset_file)
            loss = loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step >= args.steps:
                break
        epoch += 1
    dist.barrier()  # leave together (see examples/ddp_toy.py)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
