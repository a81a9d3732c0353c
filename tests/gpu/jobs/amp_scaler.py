"""Mixed precision with a GradScaler on one GPU, some steps skipped.

autocast(float16) forward, scaler.scale(loss).backward(), scaler.step(opt),
scaler.update(). Every --overflow-every-th iteration the loss is made infinite (an
overflow, as a too-high loss scale gives): the scaler finds inf gradients and skips
optimizer.step() for that iteration, so no optimizer step hook fires in it. The
growth interval is long, so the final scale tells how many iterations were skipped;
the script prints it ("amp: N iterations, K skipped"). --device cpu runs the same loop
(bfloat16 autocast on CPU). Knows nothing about traceml.
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from rank_device import rank_device

INIT_SCALE = 2.0**16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=80, help="training iterations")
    p.add_argument("--overflow-every", type=int, default=10)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = p.parse_args()

    device = rank_device(args.device)
    amp_dtype = torch.float16 if args.device == "cuda" else torch.bfloat16
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.dim, 2048), nn.ReLU(), nn.Linear(2048, 2048),
                          nn.ReLU(), nn.Linear(2048, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler(device.type, init_scale=INIT_SCALE, growth_interval=10**6)
    loss_fn = nn.CrossEntropyLoss()
    xs = torch.randn(args.batch * 8, args.dim)
    data = TensorDataset(xs, torch.randint(0, 10, (len(xs),)))
    loader = DataLoader(data, batch_size=args.batch, shuffle=True, drop_last=True,
                        pin_memory=device.type == "cuda")

    it = 0
    while it < args.steps:
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=amp_dtype):
                loss = loss_fn(model(x), y)
            if args.overflow_every and it % args.overflow_every == args.overflow_every - 1:
                loss = loss * math.inf  # an overflow: this iteration's update is skipped
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            it += 1
            if it >= args.steps:
                break
    skipped = round(math.log2(INIT_SCALE / scaler.get_scale())) if scaler.is_enabled() else 0
    print(f"amp: {it} iterations, {skipped} skipped", flush=True)


if __name__ == "__main__":
    main()
