"""Holds a known amount of GPU memory and keeps the GPU busy, for comparing the agent's
NVML figures with `nvidia-smi`.

Allocates --hold-mb through torch's allocator, then trains a small model whose forward
also runs --matmuls large matmuls (the GPU stays near 100 % busy), until the file
--stop-file exists or --max-seconds pass. Writes --info (JSON: the GPU's UUID as torch
reports it, the pid) once the memory is held, so the test knows which GPU to ask
nvidia-smi about. Knows nothing about traceml.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch import nn

from rank_device import rank_device


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hold-mb", type=int, default=4096)
    p.add_argument("--matmuls", type=int, default=8)
    p.add_argument("--info", type=Path, required=True)
    p.add_argument("--stop-file", type=Path, required=True)
    p.add_argument("--max-seconds", type=float, default=120.0)
    args = p.parse_args()

    device = rank_device()
    held = torch.ones(args.hold_mb * 2**20, dtype=torch.uint8, device=device)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    a = torch.randn(4096, 4096, device=device)
    x = torch.randn(256, 4096, device=device)
    y = torch.randint(0, 10, (256,), device=device)
    loss_fn = nn.CrossEntropyLoss()

    uuid = str(torch.cuda.get_device_properties(device).uuid)
    tmp = args.info.with_suffix(".tmp")
    tmp.write_text(json.dumps({"uuid": uuid, "pid": os.getpid(), "hold_mb": args.hold_mb}))
    os.replace(tmp, args.info)

    end = time.monotonic() + args.max_seconds
    steps = 0
    while not args.stop_file.exists() and time.monotonic() < end:
        z = a
        for _ in range(args.matmuls):
            z = torch.tanh(z @ a)  # busy work on the device
        loss = loss_fn(model(x + z[:256].mean()), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        steps += 1
        if steps % 20 == 0:
            torch.cuda.current_stream(device).synchronize()  # keep the host near the GPU
    print(f"done {steps} steps holding {held.numel() // 2**20} MiB", flush=True)


if __name__ == "__main__":
    main()
