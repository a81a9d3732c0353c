"""An optimizer step compiled with torch.compile, trained on one GPU (issue 40, item 6).

PyTorch's compiled-optimizer recipe: `torch.compile(opt.step)` over AdamW with a tensor
learning rate (inductor fuses the update), or, with --fullgraph, a plain SGD step that
Dynamo can trace whole (torch's own optimizers break their graph on purpose, so
fullgraph=True fails for them with or without traceml). Every step must still be
counted, and nothing of traceml's may break the graph or raise here. Knows nothing about
traceml. --device cpu tries the loop without a GPU (the "eager" backend).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

from rank_device import rank_device

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))  # tests/support
from plain_sgd import PlainSGD  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--fullgraph", action="store_true")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = p.parse_args()

    device = rank_device(args.device)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 10)).to(device)
    if args.fullgraph:
        opt: torch.optim.Optimizer = PlainSGD(model.parameters(), lr=1e-3)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3))
    backend = "inductor" if device.type == "cuda" else "eager"
    step = torch.compile(opt.step, backend=backend, fullgraph=args.fullgraph)
    x = torch.randn(256, 512, device=device)
    y = torch.randint(0, 10, (256,), device=device)
    for _ in range(args.steps):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        step()
    print(f"done {args.steps} steps, loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
