"""Mistake: plain BatchNorm with 8 samples per rank. Each rank normalises with statistics
of its own 8 samples (SyncBatchNorm would use all ranks'; it needs GPU backends).

    python -m torch.distributed.run --nproc-per-node 2 examples/mistakes/batchnorm-not-synced.py
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
    data = RandomData(320)
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0),
                        drop_last=True)
    model = DDP(make_model(batchnorm=True))  # MISTAKE: BatchNorm1d at 8 samples per rank
    train(model, loader)
    finish("batchnorm-not-synced", t0)


if __name__ == "__main__":
    main()
    close()
