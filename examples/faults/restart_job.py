"""A small DDP job (CPU, gloo) for torchrun's elastic restarts.

It knows nothing about traceml. One rank raises once, in the first attempt only: torchrun
(`--max-restarts 1`) then restarts the whole group, and the second attempt runs to the end.
torchrun tells each worker its attempt in TORCHELASTIC_RESTART_COUNT (0 for the first).

    traceml run examples/faults/restart_job.py --nproc-per-node 3 --max-restarts 1 \\
        -- --fail-rank 2 --fail-at-step 40

Without --fail-rank it runs to the end in one attempt (the near miss: restarts allowed,
none needed).
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--fail-rank", type=int, default=None,
                   help="this rank raises ValueError at --fail-at-step (in the first attempt)")
    p.add_argument("--fail-at-step", type=int, default=40)
    p.add_argument("--fail-attempts", type=int, default=1,
                   help="it raises in this many attempts (from the first; default 1): more "
                        "than --max-restarts allows, and the job fails as a whole")
    p.add_argument("--kill", action="store_true",
                   help="the failing rank SIGKILLs itself instead of raising (no goodbye)")
    p.add_argument("--dim", type=int, default=128)
    args = p.parse_args()

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(1)  # several ranks share a few cores
    # Each attempt's keys under a prefix of their own in torchrun's store: gloo would read
    # the failed attempt's addresses from the reused store and never connect (torch 2.x).
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt_{attempt}", store),
                            rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(args.dim, args.dim), nn.ReLU(), nn.Linear(args.dim, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, args.dim)
    y = torch.randint(0, 10, (32,))
    for step in range(args.steps):
        if attempt < args.fail_attempts and rank == args.fail_rank and step == args.fail_at_step:
            if args.kill:
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError(f"bad batch at step {step} (attempt {attempt})")
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    # Leave together, then free what holds the group before destroying it (as
    # examples/ddp_toy.py does): a rank tearing gloo down while a peer still sends, or a
    # group left to the interpreter's teardown, can abort a finished rank ("terminate
    # called without an active exception": fresh-clone run 28's restarted attempt).
    dist.barrier()
    del model, opt
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
