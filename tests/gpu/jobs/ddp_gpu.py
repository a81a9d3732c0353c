"""DDP on one GPU: every rank on the same device (gloo on CUDA tensors) or one rank on NCCL.

Knows nothing about traceml. Options make it each GPU case of the suite:
  --backend gloo|nccl     gloo lets several ranks share one GPU (NCCL refuses duplicates)
  --straggler-rank R      rank R does --extra-matmuls GPU matmuls inside its forward: a
                          compute straggler visible only on the device clock (the host
                          returns from the launches at once and waits later, in sync)
  --workers N             DataLoader workers, forked after the parent has used CUDA
  --no-set-device         never call torch.cuda.set_device: model.to(f"cuda:{local_rank}")
                          (modulo the GPUs visible), the current device stays 0
  --device cpu            the same script on CPU (to try it without a GPU)
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class RandomData(Dataset):
    """CPU tensors, as a real dataset yields: workers never touch CUDA."""

    def __init__(self, n: int, dim: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class Net(nn.Module):
    def __init__(self, dim: int, extra_matmuls: int, extra_dim: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(dim, 1024), nn.ReLU(), nn.Linear(1024, 1024),
                                  nn.ReLU(), nn.Linear(1024, 10))
        self.extra_matmuls = extra_matmuls
        # A rank-local branch: extra device work whose result is not used (a buffer, so
        # DDP does not see it as a parameter without a gradient).
        self.register_buffer("extra", torch.randn(extra_dim, extra_dim) / extra_dim**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.extra
        for _ in range(self.extra_matmuls):
            z = z @ self.extra
        return self.body(x)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--straggler-rank", type=int, default=None)
    p.add_argument("--extra-matmuls", type=int, default=40)
    p.add_argument("--extra-dim", type=int, default=2048)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--no-set-device", action="store_true")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    if args.device == "cuda":
        index = local_rank % torch.cuda.device_count()
        device = torch.device(f"cuda:{index}")
        if not args.no_set_device:
            torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    extra = args.extra_matmuls if rank == args.straggler_rank else 0
    # Without set_device the model goes to its device by name: the current device stays 0.
    model = Net(args.dim, extra, args.extra_dim).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    data = RandomData(args.batch * world * 16, args.dim)
    # Forked workers (Linux's default start method), after the parent has used CUDA: the
    # agent's hooks in them must stay inert (CUDA cannot be used after a fork).
    loader = DataLoader(data, batch_size=args.batch, drop_last=True,
                        sampler=DistributedSampler(data, seed=0), num_workers=args.workers,
                        multiprocessing_context="fork" if args.workers else None,
                        pin_memory=args.device == "cuda")

    step, epoch = 0, 0
    while step < args.steps:
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            loss = loss_fn(ddp(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step >= args.steps:
                break
        epoch += 1
    final = loss.item()  # the script's own sync, once, at the end
    if device.type == "cuda":
        where = f"current device {torch.cuda.current_device()}, model on {device}"
    else:
        where = "cpu"
    print(f"rank {rank}: done {step} steps, loss {final:.4f}, {where}", flush=True)
    dist.barrier()
    del ddp, model, opt, loader
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
