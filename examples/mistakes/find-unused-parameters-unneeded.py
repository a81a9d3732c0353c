"""Mistake: find_unused_parameters=True on a model whose every parameter is used in every
step. DDP then walks the autograd graph each iteration for nothing.

    python -m torch.distributed.run --nproc-per-node 2 \
        examples/mistakes/find-unused-parameters-unneeded.py
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
    loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data, seed=0),
                        drop_last=True)
    model = DDP(make_model(), find_unused_parameters=True)  # MISTAKE: nothing is unused
    train(model, loader)
    finish("find-unused-parameters-unneeded", t0)


if __name__ == "__main__":
    main()
    close()
