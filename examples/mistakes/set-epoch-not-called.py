"""Mistake: DistributedSampler without set_epoch. Its shuffle is seeded by seed + epoch,
so without set_epoch(epoch) every epoch repeats the first epoch's order exactly.

    python -m torch.distributed.run --nproc-per-node 2 examples/mistakes/set-epoch-not-called.py
"""

from __future__ import annotations

import time

from _common import STEPS, RandomData, close, finish, make_model, setup
from torch import nn, optim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    t0 = time.perf_counter()
    setup()
    data = RandomData(320)  # 10 batches per rank per epoch: 3 epochs in 30 steps
    loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data, seed=0),
                        drop_last=True)
    model = DDP(make_model())
    opt = optim.SGD(model.parameters(), lr=0.05)
    loss_fn = nn.CrossEntropyLoss()
    for _epoch in range(STEPS // len(loader)):
        # MISTAKE: loader.sampler.set_epoch(_epoch) is missing
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            opt.step()
    finish("set-epoch-not-called", t0)


if __name__ == "__main__":
    main()
    close()
