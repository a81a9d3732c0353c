"""Mistake: a dataset size not divisible by the world size, with DistributedSampler's
default drop_last=False: it pads the shards by repeating samples (321 -> 2 x 161).

    python -m torch.distributed.run --nproc-per-node 2 examples/mistakes/uneven-shards.py
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
    data = RandomData(321)  # MISTAKE: 321 % 2 == 1, so one sample is repeated each epoch
    loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data, seed=0),
                        drop_last=True)
    model = DDP(make_model())
    train(model, loader)
    finish("uneven-shards", t0)


if __name__ == "__main__":
    main()
    close()
