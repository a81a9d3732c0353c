"""DDP with a side-stream prefetcher: the next batch is copied to the GPU on a
torch.cuda.Stream of its own while the current step computes (the apex/NVIDIA
data_prefetcher pattern: pinned batches, non_blocking copies under
`with torch.cuda.stream(side)`, the compute stream waiting for the side stream, and
record_stream so the caching allocator keeps the batch alive).

The `.to()` calls run while the current stream is the side stream, so a timing event
recorded "on the current stream" there is on another stream than the step's: the pairs
the agent makes across them can come out negative. Knows nothing about traceml.
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from rank_device import rank_device


class Prefetcher:
    """Iterates a loader one batch ahead, copying on a side stream."""

    def __init__(self, loader: DataLoader, device: torch.device) -> None:
        self.loader = loader
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def __iter__(self):
        self.it = iter(self.loader)
        self._preload()
        return self

    def _preload(self) -> None:
        try:
            x, y = next(self.it)
        except StopIteration:
            self.next = None
            return
        with torch.cuda.stream(self.stream):
            self.next = (x.to(self.device, non_blocking=True),
                         y.to(self.device, non_blocking=True))

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        compute = torch.cuda.current_stream(self.device)
        compute.wait_stream(self.stream)
        batch = self.next
        if batch is None:
            raise StopIteration
        for t in batch:
            t.record_stream(compute)
        self._preload()
        return batch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--dim", type=int, default=1024)
    args = p.parse_args()

    device = rank_device()
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.dim, 2048), nn.ReLU(), nn.Linear(2048, 2048),
                          nn.ReLU(), nn.Linear(2048, 10)).to(device)
    ddp = DDP(model, device_ids=[device.index])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    xs = torch.randn(args.batch * world * 8, args.dim)
    data = TensorDataset(xs, torch.randint(0, 10, (len(xs),)))
    loader = DataLoader(data, batch_size=args.batch, sampler=DistributedSampler(data, seed=0),
                        drop_last=True, pin_memory=True)

    step, epoch = 0, 0
    while step < args.steps:
        loader.sampler.set_epoch(epoch)
        for x, y in Prefetcher(loader, device):
            loss = loss_fn(ddp(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step >= args.steps:
                break
        epoch += 1
    print(f"rank {rank}: done {step} steps, loss {loss.item():.4f}", flush=True)
    dist.barrier()
    del ddp, model, opt, loader
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
