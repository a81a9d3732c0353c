"""Mistake: a DistributedSampler built for rank 0 on every rank (rank=0 copied from a
single-process script): every rank reads shard 0, the other shards are never seen.

    python -m torch.distributed.run --nproc-per-node 2 examples/mistakes/sampler-shard-mismatch.py
"""

from __future__ import annotations

import time

from _common import RandomData, close, finish, make_model, setup, train
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    t0 = time.perf_counter()
    _, world = setup()
    data = RandomData(320)
    sampler = DistributedSampler(data, num_replicas=world, rank=0, seed=0)  # MISTAKE: rank=0
    loader = DataLoader(data, batch_size=16, sampler=sampler, drop_last=True)
    model = DDP(make_model())
    train(model, loader)
    finish("sampler-shard-mismatch", t0)


if __name__ == "__main__":
    main()
    close()
