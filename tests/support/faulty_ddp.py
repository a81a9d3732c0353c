"""A small DDP job (CPU, gloo) that keeps its own record, for tests/e2e/test_faults.py.

The fault tests ask what traceml kept against what the job really did, so the job
must say what it did without traceml: every rank appends "STEP WALL_TIME" to
PROGRESS_DIR/rankR.txt after each optimizer step (line-buffered, so a test reads it
live), and rank 0 prints "done: N steps in X s" like examples/ddp_toy.py.

Each step sleeps --step-ms inside forward, so the pace is set by the clock more than
by the shared CPUs, and a change of speed caused by a fault stands out of the noise.

Faults it can inject:
  --raise-rank R --raise-at-step S   rank R raises RuntimeError at step S (a traceback)
  --ignore-sigterm                   every rank ignores SIGTERM (a job that will not stop)
  --quiet                            print nothing (a job whose output cannot fail it)
  --slow-input-ranks R,R --slow-ms M  those ranks take M ms more to get each batch
  --abort-at-exit-rank R             rank R's script returns, then it aborts at exit
                                     (SIGABRT after the agent's goodbye said 0)
  --break-agent-at S                 from step S the agent's recorder raises on every
                                     call (an agent bug): it must turn itself off, say
                                     so, and never be taken for a hang
"""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Net(nn.Module):
    def __init__(self, step_s: float) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        self.step_s = step_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.step_s:
            time.sleep(self.step_s)
        return self.body(x)


class SlowCollate:
    """The default collate, then a sleep: a rank whose input pipeline is slow."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def __call__(self, batch: list) -> object:
        time.sleep(self.delay_s)
        return torch.utils.data.default_collate(batch)


def break_agent() -> None:
    import traceml_agent

    rec = traceml_agent._state["rec"]

    def broken(*args: object, **kwargs: object) -> bool:
        raise RuntimeError("injected agent bug")

    cls = type(rec)  # a slotted instance: the methods are broken on its class
    cls.begin = cls.end = cls.begin_backward = broken


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--progress", type=Path, default=None, metavar="DIR")
    p.add_argument("--raise-rank", type=int, default=None)
    p.add_argument("--raise-at-step", type=int, default=10)
    p.add_argument("--ignore-sigterm", action="store_true")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--slow-input-ranks", default="", metavar="R,R")
    p.add_argument("--slow-ms", type=float, default=25.0)
    p.add_argument("--break-agent-at", type=int, default=None, metavar="STEP")
    p.add_argument("--abort-at-exit-rank", type=int, default=None, metavar="R",
                   help="rank R finishes its script, then aborts at interpreter exit (an "
                        "atexit handler: after the agent's goodbye, as a C++ teardown does)")
    # A test that must act while the job still runs, however slow the machine: the job
    # runs up to --steps, or stops at the step written in this file once it appears (each
    # rank reads it, so all stop at the same step; the test writes one far enough ahead).
    p.add_argument("--stop-file", type=Path, default=None, metavar="FILE")
    args = p.parse_args()

    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.abort_at_exit_rank == rank:
        atexit.register(os.abort)  # runs after runpy returns, so after the goodbye
    log = None
    if args.progress is not None:
        args.progress.mkdir(parents=True, exist_ok=True)
        log = open(args.progress / f"rank{rank}.txt", "w", buffering=1)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(3840, 64, generator=g), torch.randint(0, 10, (3840,),
                                                                           generator=g))
    slow = rank in {int(r) for r in args.slow_input_ranks.split(",") if r}
    collate = SlowCollate(args.slow_ms / 1000.0) if slow else None
    loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data, seed=0),
                        drop_last=True, collate_fn=collate)
    torch.manual_seed(0)
    model = DDP(Net(args.step_ms / 1000.0))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()

    step, epoch = 0, 0
    t0 = time.perf_counter()
    last = args.steps

    def stop_at() -> int:
        if args.stop_file is None or last != args.steps or not args.stop_file.exists():
            return last
        try:
            return min(args.steps, int(args.stop_file.read_text()))
        except ValueError:  # being written: read again at the next step
            return last

    while step < last:
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            if step == args.break_agent_at:
                break_agent()
            if args.raise_rank == rank and step == args.raise_at_step:
                raise RuntimeError(f"injected fault on rank {rank} at step {step}")
            loss = loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if log is not None:
                log.write(f"{step} {time.time():.6f}\n")
            last = stop_at()
            if step >= last:
                break
        epoch += 1
    elapsed = time.perf_counter() - t0
    if rank == 0 and not args.quiet:
        print(f"done: {step} steps in {elapsed:.2f} s ({step / elapsed:.2f} steps/s)",
              flush=True)
    dist.barrier()  # leave together (see examples/ddp_toy.py)
    # Free what holds the process group first (a DDP or FSDP model does): else gloo's
    # context outlives destroy_process_group and goes in the interpreter's own teardown,
    # whose threads can abort the finished process (examples/mistakes/_common.close).
    del model, opt, loader
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
