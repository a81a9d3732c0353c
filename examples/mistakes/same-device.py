"""Mistake: every rank on the same GPU (cuda:0 hard-coded instead of LOCAL_RANK). The
ranks share one GPU's memory and compute while the others idle. NEEDS CUDA.

With NCCL, two ranks on one GPU fail at DDP construction ("Duplicate GPU detected");
with gloo (used here, as some jobs do) the job runs, slowly, and only a cross-rank
comparison of the devices shows it. On a one-GPU machine this is what every rank does.

    python -m torch.distributed.run --nproc-per-node 2 examples/mistakes/same-device.py
"""

from __future__ import annotations

import time

import torch
from _common import STEPS, RandomData, close, finish, make_model, setup
from torch import nn, optim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("same-device.py needs a CUDA GPU: the mistake is two ranks on one GPU")
    t0 = time.perf_counter()
    setup()
    device = torch.device("cuda", 0)  # MISTAKE: torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    data = RandomData(320)
    loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data, seed=0),
                        drop_last=True)
    model = DDP(make_model().to(device), device_ids=[0])
    opt = optim.SGD(model.parameters(), lr=0.05)
    loss_fn = nn.CrossEntropyLoss()
    step, epoch = 0, 0
    while step < STEPS:
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            opt.step()
            step += 1
            if step >= STEPS:
                break
        epoch += 1
    finish("same-device", t0)


if __name__ == "__main__":
    main()
    close()
