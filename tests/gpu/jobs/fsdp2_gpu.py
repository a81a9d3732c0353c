"""FSDP2 (`fully_shard`) on one GPU: one rank on NCCL (NCCL refuses two ranks on one GPU).

Each block is its own FSDP unit, so forward all-gathers and backward reduce-scatters
layer by layer, on FSDP's own CUDA streams: the agent's events for those collectives
sit on other streams than the compute's. --offload keeps the parameters on the CPU
(CPUOffloadPolicy): no parameter is on CUDA, yet the work is. --device cpu runs the
same loop on gloo without a GPU. Knows nothing about traceml.
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

from rank_device import rank_device


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--offload", action="store_true")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = p.parse_args()

    device = rank_device(args.device)
    if args.device == "cuda":
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(args.dim, args.dim), nn.ReLU())
                            for _ in range(4)], nn.Linear(args.dim, 1))
    if not args.offload:
        model = model.to(device)
    policy = CPUOffloadPolicy() if args.offload else OffloadPolicy()
    for block in model:
        fully_shard(block, offload_policy=policy)
    fully_shard(model, offload_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    for _ in range(args.steps):
        x = torch.randn(args.batch, args.dim, device=device)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    where = next(model.parameters()).device
    print(f"rank {rank}: done {args.steps} steps, loss {loss.item():.4f}, "
          f"parameters on {where}", flush=True)
    dist.barrier()
    del model, opt
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
