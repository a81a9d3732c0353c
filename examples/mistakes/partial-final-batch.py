"""Mistake: each rank's share (168 samples) is not a multiple of the batch (16) and the
DataLoader keeps the remainder: every epoch ends with a batch of 8.

    python -m torch.distributed.run --nproc-per-node 2 examples/mistakes/partial-final-batch.py
"""

from __future__ import annotations

import time

from _common import RandomData, close, finish, make_model, setup, train
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    t0 = time.perf_counter()
    setup()
    data = RandomData(336)
    loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data, seed=0))  # MISTAKE
    model = DDP(make_model())
    train(model, loader)
    finish("partial-final-batch", t0)


if __name__ == "__main__":
    main()
    close()
