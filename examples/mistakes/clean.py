"""No setup mistake: the reference every other example changes in exactly one place.

    python -m torch.distributed.run --nproc-per-node 2 examples/mistakes/clean.py
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
    data = RandomData(320)  # divisible by the world size: no padding
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=16, sampler=sampler, drop_last=True)
    model = DDP(make_model())
    train(model, loader)  # calls sampler.set_epoch(epoch) every epoch
    finish("clean", t0)


if __name__ == "__main__":
    main()
    close()
