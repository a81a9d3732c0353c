"""Mistake: no DistributedSampler. Every rank iterates the whole dataset, so N ranks do
N times the work on the same data instead of splitting it.

    python -m torch.distributed.run --nproc-per-node 2 examples/mistakes/no-distributed-sampler.py
"""

from __future__ import annotations

import time

from _common import RandomData, close, finish, make_model, setup, train
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader


def main() -> None:
    t0 = time.perf_counter()
    setup()
    data = RandomData(320)
    loader = DataLoader(data, batch_size=16, shuffle=True, drop_last=True)  # MISTAKE: no sampler
    model = DDP(make_model())
    train(model, loader)
    finish("no-distributed-sampler", t0)


if __name__ == "__main__":
    main()
    close()
