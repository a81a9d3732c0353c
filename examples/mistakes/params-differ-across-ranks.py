"""Mistake: weights loaded on rank 0 only, after DDP was built. DDP broadcasts rank 0's
weights once, at construction; a later load_state_dict on one rank is never sent to
the others, so the ranks train different models on averaged gradients.

(Seeding each rank differently before DDP is NOT this mistake: DDP's construction
broadcast makes the weights equal again.)

    python -m torch.distributed.run --nproc-per-node 2 \
        examples/mistakes/params-differ-across-ranks.py
"""

from __future__ import annotations

import time

from _common import RandomData, close, finish, make_model, setup, train
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    t0 = time.perf_counter()
    rank, _ = setup()
    data = RandomData(320)
    loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data, seed=0),
                        drop_last=True)
    model = DDP(make_model())
    checkpoint = make_model(seed=1).state_dict()  # stands in for torch.load("pretrained.pt")
    if rank == 0:  # MISTAKE: load on every rank, or before wrapping in DDP
        model.module.load_state_dict(checkpoint)
    train(model, loader)
    finish("params-differ-across-ranks", t0)


if __name__ == "__main__":
    main()
    close()
