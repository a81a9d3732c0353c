"""A DDP job (CPU, gloo) that trains one model, drops it and its optimizer, then trains
another: a hyper-parameter search's trials, k-fold, pretraining then fine-tuning.

It knows nothing about traceml: under `traceml run` every step of both models must be
counted (the second optimizer closes steps once the first is gone), and the first model
must be freed (`--check-freed`: each rank asserts it, with the agent attached).

    traceml run examples/faults/two_models.py --nproc-per-node 2 -- --steps 40 40

  --steps A B      steps of the first model, then of the second
  --keep-first     keep the first optimizer alive (in a list) while the second trains:
                   it stops stepping, and the second must take over all the same
  --check-freed    after dropping the first model, fail unless it was garbage collected
"""

from __future__ import annotations

import argparse
import gc
import sys
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class FineTuned(nn.Module):
    """The second model: another class (a head on a fresh backbone)."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = Backbone()
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.backbone(x)))


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, out: int) -> None:
    x, y = torch.randn(32, 64), torch.randn(32, out)
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, nargs=2, default=(40, 40))
    ap.add_argument("--keep-first", action="store_true")
    ap.add_argument("--check-freed", action="store_true")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    first = DDP(Backbone())
    opt = torch.optim.Adam(first.parameters(), lr=1e-3)
    train(first, opt, args.steps[0], 64)
    kept = [opt] if args.keep_first else []
    gone = weakref.ref(first.module)
    del first, opt
    gc.collect()
    if args.check_freed and not args.keep_first and gone() is not None:
        print(f"rank {dist.get_rank()}: the first model was not freed", file=sys.stderr)
        sys.exit(3)
    second = DDP(FineTuned())
    train(second, torch.optim.Adam(second.parameters(), lr=1e-3), args.steps[1], 1)
    del kept
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
