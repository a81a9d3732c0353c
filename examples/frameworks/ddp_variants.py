"""Plain DDP, written the ways people write it: compiled, autocast, two optimizers,
an IterableDataset. Problems are injected by $FAULTS (see _faults.py).

    traceml run examples/frameworks/ddp_variants.py --nproc-per-node 3 -- --compile wrap

    --compile wrap     model = torch.compile(DDP(model))   (the common way)
    --compile method   model = DDP(model); model.compile()
    --compile step     the loss computation compiled as one function (@torch.compile on a
                       step function): the forward runs inside compiled code, where no
                       hook can see it, and traceml says so instead of guessing
    --bf16             forward and loss under torch.autocast("cpu", torch.bfloat16)
    --two-optimizers   body and head each with their own optimizer, both stepped
    --iterable         an IterableDataset split by rank instead of a DistributedSampler
"""

from __future__ import annotations

import argparse
import contextlib
import os

# One compile thread: on a small CPU machine, Inductor's pool of compile worker processes
# (one per core, per rank) only adds processes that must start and stop with each rank.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist
from _faults import SyntheticData, TinyNet, report_steps, world
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data.distributed import DistributedSampler


class Stream(IterableDataset):
    """Rank r reads items r, r+W, r+2W... of the synthetic set, in order."""

    def __init__(self, data: SyntheticData, rank: int, size: int) -> None:
        self.data, self.rank, self.size = data, rank, size

    def __iter__(self):
        for i in range(self.rank, len(self.data), self.size):
            yield self.data[i]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--compile", choices=("none", "wrap", "method", "step"), default="none")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--two-optimizers", action="store_true")
    p.add_argument("--iterable", action="store_true")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = SyntheticData(args.steps * args.batch * world(), args.batch)
    if args.iterable:
        loader = DataLoader(Stream(data, rank, world()), batch_size=args.batch)
    else:
        sampler = DistributedSampler(data, shuffle=False)
        loader = DataLoader(data, batch_size=args.batch, sampler=sampler)

    net = TinyNet()
    model = DDP(net)
    if args.compile == "wrap":
        model = torch.compile(model)
    elif args.compile == "method":
        model.compile()
    if args.two_optimizers:
        optimizers = [torch.optim.SGD(net.body[:3].parameters(), lr=0.01),
                      torch.optim.AdamW(net.body[3].parameters(), lr=1e-3)]
    else:
        optimizers = [torch.optim.SGD(net.parameters(), lr=0.01)]
    loss_fn = torch.nn.CrossEntropyLoss()
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if args.bf16
                else contextlib.nullcontext())

    def compute_loss(x, y):
        with autocast:
            return loss_fn(model(x), y)

    if args.compile == "step":
        compute_loss = torch.compile(compute_loss)

    steps = 0
    for x, y in loader:
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        loss = compute_loss(x, y)
        loss.backward()
        for opt in optimizers:
            opt.step()
        steps += 1
    report_steps(steps)
    dist.barrier()  # leave together: gloo torn down under a peer still sending can hang
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
