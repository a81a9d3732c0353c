"""Mistake: nn.DataParallel in a torchrun job. Each process wraps its model in DataParallel,
which never talks to the other processes: gradients are not averaged, ranks drift apart.

    python -m torch.distributed.run --nproc-per-node 2 examples/mistakes/data-parallel.py
"""

from __future__ import annotations

import time

from _common import RandomData, close, finish, make_model, setup, train
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    t0 = time.perf_counter()
    setup()
    data = RandomData(320)
    loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data, seed=0),
                        drop_last=True)
    model = nn.DataParallel(make_model())  # MISTAKE: DistributedDataParallel(make_model())
    train(model, loader)
    finish("data-parallel", t0)


if __name__ == "__main__":
    main()
    close()
