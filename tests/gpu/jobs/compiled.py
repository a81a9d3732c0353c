"""A model compiled with torch.compile(mode="reduce-overhead") trained on one GPU.

"reduce-overhead" runs the compiled forward and backward as CUDA graphs (cudagraph
trees): the first calls warm up and capture them, later calls replay. The agent's
hooks step aside inside code being traced, and must record nothing while a graph is
being captured. Knows nothing about traceml. --device cpu tries the loop without a GPU
(compiled with the eager backend: no graphs there).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from rank_device import rank_device


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = p.parse_args()

    device = rank_device(args.device)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.dim, 1024), nn.GELU(), nn.Linear(1024, 1024),
                          nn.GELU(), nn.Linear(1024, 10)).to(device)
    if device.type == "cuda":
        compiled = torch.compile(model, mode="reduce-overhead")
    else:
        compiled = torch.compile(model, backend="eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    xs = torch.randn(args.batch * 16, args.dim)
    data = TensorDataset(xs, torch.randint(0, 10, (len(xs),)))
    # drop_last: one shape, so the graphs are captured once.
    loader = DataLoader(data, batch_size=args.batch, shuffle=True, drop_last=True,
                        pin_memory=device.type == "cuda")

    step = 0
    while step < args.steps:
        for x, y in loader:
            # A new iteration of cudagraph trees: the previous step's graph outputs may
            # be overwritten from here on (the documented call for training loops).
            torch.compiler.cudagraph_mark_step_begin()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = loss_fn(compiled(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step >= args.steps:
                break
    print(f"done {step} steps, loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
