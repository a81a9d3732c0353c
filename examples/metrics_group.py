"""A DDP job (CPU, gloo) that also all-gathers its metrics every step on a second group.

It knows nothing about traceml. Beside DDP's gradient all-reduce (on the default group,
inside backward), each step gathers a metrics tensor from every rank on a process group
of its own, between backward and the optimizer step, the way a logging hook or a
tensor-parallel group does: `traceml run` names both, with each one's exposed wait, in
final_summary.json's `collectives` and in the text summary (docs/network.md).

    traceml run examples/metrics_group.py --nproc-per-node 2 -- --steps 40
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--metric-floats", type=int, default=1 << 18,
                   help="floats each rank contributes to the per-step all-gather")
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    world = dist.get_world_size()
    metrics_group = dist.new_group(list(range(world)))  # a second group, same ranks
    model = DDP(nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 256)
    metrics = torch.zeros(args.metric_floats)
    gathered = [torch.empty_like(metrics) for _ in range(world)]
    for _ in range(args.steps):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        metrics[0] = loss.detach()
        dist.all_gather(gathered, metrics, group=metrics_group)
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
