"""A small, ordinary DDP training script (CPU, gloo) with injectable problems.

It knows nothing about traceml: run it under `traceml run` and the agent times it.

    traceml run examples/ddp_toy.py --nproc-per-node 4 -- --scenario input --rank 2

Scenarios (each adds --delay-ms of time where a real job would lose it):
  balanced    nothing injected
  input       one rank's batches take longer to load (slow storage, heavy collate)
  forward     one rank does extra forward work (a rank-local branch)
  optimizer   one rank does extra work in optimizer.step (a hook on one rank)
  batch       one rank gets 4x larger batches (uneven shapes)
  input-all   every rank's input is slow (an input-bound job)
  stall       every rank stalls after each step (synchronous logging/checkpoint)
  contended   one rank shares its CPU core with two busy processes (an oversubscribed
              host: other jobs, too many DataLoader workers); --delay-ms is not used
  moving      imbalance that moves: every step the ranks get work spread evenly from 0 to
              --delay-ms more forward, in an order drawn afresh each step (length-bucketed
              batches: a different rank gets the long sequences each time); --rank unused

  --jitter-ms J                        every rank's forward takes a random 0..J ms more on
                                       every step (a noisy job; drawn per rank and step)
  --accumulate N                       N micro-batches per optimizer step, the first N-1
                                       under DDP's no_sync() (gradient accumulation); the
                                       injected forward delay applies to each micro-batch

  --from-step A --to-step B            inject it on steps A..B only (both included; a
                                       transient problem), for the scenarios that add
                                       --delay-ms; default: every step

Hangs (for traceml's hang detection):
  --hang-rank R --hang-at-step S       rank R sleeps forever before its forward at step S
  --skip-collective-rank R --hang-at-step S
                                       every rank but R calls all_reduce at step S (on a
                                       group of its own, so gloo hangs as NCCL would)
  --checkpoint-every N --checkpoint-s T
                                       every rank spends T s "checkpointing" every N steps
  --startup-stall-s T                  the hang rank (else rank 0) first spends T s
                                       "loading" before its first step (a slow start on
                                       a busy machine: its stack then is not the hang's)
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import socket
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SCENARIOS = ("balanced", "input", "forward", "optimizer", "batch", "input-all", "stall",
             "compute-all", "contended", "moving")
# The busy processes of the "contended" scenario: each spins until its parent is gone.
HOG = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    sum(range(10000))\n"


def _ranks(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ranks like 2 or 2,3, got {text!r}") from None


class RandomData(Dataset):
    def __init__(self, n: int, dim: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class SlowCollate:
    """Collates a batch and then sleeps: the time a slow input pipeline costs."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def __call__(self, items):
        x = torch.stack([i[0] for i in items])
        y = torch.stack([i[1] for i in items])
        if self.delay_s:
            time.sleep(self.delay_s)
        return x, y


def fake_nccl_log(rank: int, world: int):
    """Gloo writes no NCCL log: with --fake-nccl-log each step's allreduce is logged the
    way NCCL_DEBUG=INFO would (start, then DONE), to the file NCCL_DEBUG_FILE names, so
    `traceml run --nccl-debug` can be tried on CPU."""
    pattern = os.environ.get("NCCL_DEBUG_FILE")
    if not pattern:
        return lambda line: None
    host, pid = socket.gethostname().split(".")[0], os.getpid()
    log = open(pattern.replace("%h", host).replace("%p", str(pid)), "a", buffering=1)  # noqa: SIM115
    return lambda line: log.write(f"{host}:{pid}:{pid} [{rank}] NCCL INFO {line}\n")


class Net(nn.Module):
    def __init__(self, dim: int, extra_forward_s: float = 0.0) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(dim, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                                  nn.Linear(512, 10))
        self.extra_forward_s = extra_forward_s

    def forward(self, x):
        if self.extra_forward_s:
            time.sleep(self.extra_forward_s)  # a rank-local branch doing extra work
        return self.body(x)


def wait_forever() -> None:
    while True:
        time.sleep(1.0)


def block_in_c_holding_the_gil() -> None:
    """libc's pause() through ctypes.PyDLL, which (unlike CDLL) keeps the GIL: like a
    stuck NCCL call or a deadlocked extension, no Python thread of the process runs."""
    import ctypes

    ctypes.PyDLL(None).pause()


def share_a_core_with_hogs(hogs: int = 2) -> None:
    """Pin this process to one core and start `hogs` busy processes pinned there too:
    the rank then gets a third of a core, whatever the other ranks get."""
    import atexit
    import subprocess

    core = max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})  # the children inherit it
    procs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(hogs)]
    atexit.register(lambda: [p.kill() for p in procs])


def slow_startup(seconds: float) -> None:
    time.sleep(seconds)  # e.g. loading a checkpoint or a tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--scenario", choices=SCENARIOS, default="balanced")
    p.add_argument("--rank", type=_ranks, default=(1,), metavar="R[,R...]",
                   help="the rank(s) the problem is injected on, e.g. 2 or 2,3 (a whole node)")
    p.add_argument("--delay-ms", type=float, default=25.0)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--from-step", type=int, default=0,
                   help="the first step the problem is injected on (a transient problem)")
    p.add_argument("--to-step", type=int, default=None,
                   help="the last step it is injected on (included); default: to the end")
    p.add_argument("--jitter-ms", type=float, default=0.0,
                   help="every rank's forward takes a random 0..J ms more each step")
    p.add_argument("--accumulate", type=int, default=1,
                   help="micro-batches per optimizer step (gradient accumulation, no_sync)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--compute-ms", type=float, default=0.0,
                   help="every rank's forward first waits this long: accelerator compute, "
                        "which (unlike this script's CPU math) does not compete for the "
                        "cores the ranks of a CPU demo share")
    p.add_argument("--fail-rank", type=int, default=None,
                   help="this rank exits with --fail-code (3) at --fail-at-step")
    p.add_argument("--fail-at-step", type=int, default=10)
    p.add_argument("--fail-code", type=int, default=3,
                   help="the code --fail-rank exits with (256 exits 0: the shell's byte)")
    p.add_argument("--hang-rank", type=int, default=None)
    p.add_argument("--skip-collective-rank", type=int, default=None)
    p.add_argument("--gil-hang-rank", type=int, default=None,
                   help="this rank blocks in a C call that holds the GIL at --hang-at-step "
                        "(its agent's thread can then send nothing: a native-code hang)")
    p.add_argument("--extra-collective-rank", type=int, default=None,
                   help="this rank alone enters an all_reduce at --hang-at-step")
    p.add_argument("--hang-at-step", type=int, default=20)
    p.add_argument("--fake-nccl-log", action="store_true",
                   help="log each step's allreduce as NCCL_DEBUG=INFO would (gloo has none)")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--checkpoint-s", type=float, default=3.0)
    p.add_argument("--checkpoint-rank", type=int, default=None,
                   help="only this rank checkpoints (synchronously, as rank 0 often does)")
    p.add_argument("--startup-stall-s", type=float, default=0.0)
    args = p.parse_args()

    torch.set_num_threads(1)  # several ranks share a few cores
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    me = rank in args.rank
    if args.scenario == "contended" and me:
        share_a_core_with_hogs()
    if args.startup_stall_s and rank == (args.hang_rank or 0):
        slow_startup(args.startup_stall_s)
    diverges = args.skip_collective_rank is not None or args.extra_collective_rank is not None
    side_group = dist.new_group() if diverges else None
    delay = args.delay_ms / 1000.0
    last = args.to_step if args.to_step is not None else args.steps

    def faulty(step: int) -> bool:
        return args.from_step <= step <= last

    def moving_s(step: int) -> float:
        """This rank's share of the step's uneven work: the ranks' order is drawn from the
        step number, so every rank draws the same one (one gets it all, one none)."""
        if args.scenario != "moving" or not faulty(step) or world < 2:
            return 0.0
        order = list(range(world))
        random.Random(step).shuffle(order)
        return delay * order.index(rank) / (world - 1)

    noise = random.Random(1000 + rank)

    batch = args.batch * (4 if args.scenario == "batch" and me else 1)
    slow_input = (args.scenario == "input" and me) or args.scenario == "input-all"
    data = RandomData(batch * world * 64, args.dim)
    collate = SlowCollate(delay if slow_input else 0.0)
    loader = DataLoader(data, batch_size=batch, sampler=DistributedSampler(data, seed=0),
                        collate_fn=collate, drop_last=True)
    torch.manual_seed(0)
    # "compute-all": every rank's forward takes --delay-ms longer (a model whose compute
    # dwarfs its gradient allreduce: sync is then a modest share of the step).
    extra = (args.scenario == "forward" and me) or args.scenario == "compute-all"
    net = Net(args.dim, (delay if extra else 0.0) + args.compute_ms / 1000.0)
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if args.scenario == "optimizer" and me:
        opt.register_step_pre_hook(lambda *a: time.sleep(delay if faulty(step) else 0.0))
    loss_fn = nn.CrossEntropyLoss()

    nccl = fake_nccl_log(rank, world) if args.fake_nccl_log else (lambda line: None)
    step, epoch = 0, 0
    t0 = time.perf_counter()
    while step < args.steps:
        loader.sampler.set_epoch(epoch)
        collate.delay_s = delay if slow_input and faulty(step) else 0.0  # the next batch's
        for x, y in loader:
            net.extra_forward_s = ((delay if extra and faulty(step) else 0.0)
                                   + args.compute_ms / 1000.0 + moving_s(step)
                                   + noise.uniform(0.0, args.jitter_ms) / 1000.0)
            if args.hang_rank == rank and step == args.hang_at_step:
                wait_forever()  # e.g. a deadlock in this rank's own code
            if args.gil_hang_rank == rank and step == args.hang_at_step:
                block_in_c_holding_the_gil()
            nccl(f"AllReduce: opCount {step:x} size 4 datatype 7 op 0 root 0 comm 0x5a5a "
                 f"[nranks={world}] stream 0x0")
            if args.skip_collective_rank is not None and step == args.hang_at_step:
                if rank != args.skip_collective_rank:  # a conditional collective
                    dist.all_reduce(torch.ones(1), group=side_group)
            if args.extra_collective_rank == rank and step == args.hang_at_step:
                dist.all_reduce(torch.ones(1), group=side_group)  # only this rank's path
            opt.zero_grad(set_to_none=True)
            for _ in range(args.accumulate - 1):  # gradients accumulate locally
                with model.no_sync():
                    loss_fn(model(x), y).backward()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            if args.scenario == "stall" and faulty(step):
                time.sleep(delay)  # e.g. synchronous logging or checkpointing every step
            if (args.checkpoint_every and step and step % args.checkpoint_every == 0
                    and args.checkpoint_rank in (None, rank)):
                time.sleep(args.checkpoint_s)  # a legitimate long step: not a hang
            nccl(f"AllReduce: opCount {step:x} DONE")
            step += 1
            collate.delay_s = delay if slow_input and faulty(step) else 0.0
            if args.fail_rank == rank and step == args.fail_at_step:
                print(f"rank {rank}: simulated failure at step {step}", file=sys.stderr)
                sys.exit(args.fail_code)
            if step >= args.steps:
                break
        epoch += 1
    elapsed = time.perf_counter() - t0
    if rank == 0:
        print(f"done: {step} steps in {elapsed:.1f} s ({1000 * elapsed / step:.1f} ms/step), "
              f"scenario={args.scenario}, world={world}, pid={os.getpid()}")
    # Leave together: a rank tearing gloo down while another still sends can abort
    # ("terminate called without an active exception") on this torch build.
    dist.barrier()
    # Free what holds the process group first (a DDP or FSDP model does): else gloo's
    # context outlives destroy_process_group and goes in the interpreter's own teardown,
    # whose threads can abort the finished process (examples/mistakes/_common.close).
    del model, opt, loader
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
