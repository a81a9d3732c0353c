"""Where a straggler's backward time goes, without traceml: each rank's backward (to the
moment every gradient is ready, before DDP waits for its allreduces) timed by hand with
its training thread's CPU time and context switches (docs/diagnosis.md, HOST_SHARED_WAIT).

    taskset -c 1 python3 -c 'while True: pass' &   # a busy neighbour on one core
    torchrun --nproc-per-node 3 benchmarks/backward_off_cpu.py; kill %1

A rank whose backward is slow with the same CPU time and involuntary switches (not
voluntary ones) was preempted there, not asleep: its host's cores, not its work.
"""

from __future__ import annotations

import statistics
import threading
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS, WARMUP = 300, 20


def switches(tid: int) -> tuple[int, int]:
    """The thread's (voluntary, involuntary) context switches so far."""
    text = open(f"/proc/self/task/{tid}/status").read()  # noqa: SIM115 - a proc read

    def field(name: str) -> int:
        return int(text.split(f"\n{name}:")[1].split()[0])
    return field("voluntary_ctxt_switches"), field("nonvoluntary_ctxt_switches")


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, tid = dist.get_rank(), threading.get_native_id()
    # examples/ddp_toy.py's model: two gradient buckets, the first all-reduced (on gloo's
    # thread) while backward still runs.
    net = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                        nn.Linear(512, 10))
    model, x, y = DDP(net), torch.randn(32, 256), torch.randint(0, 10, (32,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ready: dict[str, object] = {}

    def on_ready() -> None:
        ready["cpu"], ready["wall"] = time.thread_time_ns(), time.perf_counter_ns()
        ready["sw"] = switches(tid)

    net[4].bias.register_post_accumulate_grad_hook(  # the first gradient ready
        lambda p: torch.autograd.Variable._execution_engine.queue_callback(on_ready))
    rows = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        sw0 = switches(tid)
        wall0, cpu0 = time.perf_counter_ns(), time.thread_time_ns()
        loss.backward()
        opt.step()
        if step >= WARMUP:
            vol, invol = (a - b for a, b in zip(ready["sw"], sw0, strict=True))
            rows.append(((ready["wall"] - wall0) / 1e6, (ready["cpu"] - cpu0) / 1e6, vol, invol))
    med = statistics.median(r[0] for r in rows)
    slow = [r for r in rows if r[0] > 2 * med]
    print(f"rank {rank}: backward median {med:.2f} ms, mean "
          f"{statistics.mean(r[0] for r in rows):.2f}; on CPU median "
          f"{statistics.median(r[1] for r in rows):.2f} ms; {len(slow)} slow (> 2x median): "
          f"on CPU {statistics.mean(r[1] for r in slow) if slow else 0:.2f} ms, switches "
          f"voluntary {sum(r[2] for r in slow)}, involuntary {sum(r[3] for r in slow)}",
          flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
