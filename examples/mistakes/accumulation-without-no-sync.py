"""Mistake: gradient accumulation without no_sync(). Four micro-batches per optimizer
step, each backward allreduces every gradient; only the last allreduce is needed.

    python -m torch.distributed.run --nproc-per-node 2 \
        examples/mistakes/accumulation-without-no-sync.py
"""

from __future__ import annotations

import time

from _common import STEPS, RandomData, close, finish, make_model, setup
from torch import nn, optim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

ACCUMULATE = 4


def main() -> None:
    t0 = time.perf_counter()
    setup()
    data = RandomData(320)
    loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, seed=0),
                        drop_last=True)
    model = DDP(make_model())
    opt = optim.SGD(model.parameters(), lr=0.05)
    loss_fn = nn.CrossEntropyLoss()
    step, epoch = 0, 0
    while step < STEPS:
        loader.sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            # MISTAKE: micro-batches but the last should run inside `with model.no_sync():`
            (loss_fn(model(x), y) / ACCUMULATE).backward()
            if (i + 1) % ACCUMULATE == 0:
                opt.step()
                opt.zero_grad(set_to_none=True)
                step += 1
                if step >= STEPS:
                    break
        epoch += 1
    finish("accumulation-without-no-sync", t0)


if __name__ == "__main__":
    main()
    close()
