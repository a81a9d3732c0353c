"""A training loop written with Hugging Face Accelerate the way its docs show
(`accelerator.accumulate`, `accelerator.backward`), DDP on CPU (gloo). Problems are
injected by $FAULTS (see _faults.py).

    traceml run examples/frameworks/accelerate_loop.py --nproc-per-node 3
"""

from __future__ import annotations

import argparse

import torch
from _faults import SyntheticData, TinyNet, report_steps, world
from accelerate import Accelerator
from torch.utils.data import DataLoader


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--accumulate", type=int, default=2)
    args = p.parse_args()

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accumulate)
    micro = args.steps * args.accumulate
    data = SyntheticData(micro * args.batch * world(), args.batch)
    loader = DataLoader(data, batch_size=args.batch, shuffle=False)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    loss_fn = torch.nn.CrossEntropyLoss()

    steps = 0
    model.train()
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = loss_fn(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            steps += 1
    report_steps(steps)


if __name__ == "__main__":
    main()
