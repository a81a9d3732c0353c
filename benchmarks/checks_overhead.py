"""Cost of the setup-mistake checks (agent/checks.py), measured in-process on real objects:
a DDP module (one-rank gloo group), a DataLoader iterator over a DistributedSampler.

    python benchmarks/checks_overhead.py --rounds 30 --steps 20000

Per step, the hooks will call on_loader_batch, on_backward (once per backward) and
on_optimizer_step. Those calls are timed directly, in blocks alternating with an empty
loop of the same shape (the difference is the observer's cost), because their cost
(well under a microsecond) is far below the run-to-run noise of an A/B on a training
loop (+-15 us per step on this machine, see agent_overhead.out). Also timed: the
once-per-epoch pass check, the DDP stats read of the first FIND_UNUSED_STEPS steps,
and the one-off costs (model and loader inspection, the parameter checksum of a
10M-parameter model, against a full float64 sum of every weight).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def per_call_ns(fn, n: int) -> float:
    t0 = time.perf_counter_ns()
    fn(n)
    return (time.perf_counter_ns() - t0) / n


def paired(observed, bare, rounds: int, n: int) -> dict[str, float]:
    """Median and IQR of (observed - bare) ns per step, over alternating blocks."""
    diffs = []
    for _ in range(rounds):
        b = per_call_ns(bare, n)
        o = per_call_ns(observed, n)
        diffs.append(o - b)
    q = statistics.quantiles(diffs, n=4)
    return {"median_ns": round(statistics.median(diffs), 1), "iqr_ns": [round(q[0], 1),
                                                                        round(q[2], 1)]}


def once_us(fn, repeat: int = 7) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return round(statistics.median(times) / 1000, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--steps", type=int, default=20_000)
    args = p.parse_args()

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    from traceml_agent import checks
    from traceml_agent.checks import StepObserver

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)

    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)))
    data = TensorDataset(torch.randn(1024, 64), torch.randint(0, 4, (1024,)))
    loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data, 2, 0))
    it = iter(loader)
    next(it)

    obs = StepObserver(rank=0, world_size=2)
    obs.watch_model(ddp)
    obs.on_loader_batch(it)
    obs.on_optimizer_step()  # the first pass: the loader is inspected here, once
    assert obs.error is None and obs.drain() == []

    def step(n: int) -> None:  # one backward per optimizer step
        for _ in range(n):
            obs.on_loader_batch(it)
            obs.on_backward()
            obs.on_optimizer_step()

    def step4(n: int) -> None:  # four micro-batches per step
        for _ in range(n):
            obs.on_loader_batch(it)
            obs.on_backward()
            obs.on_loader_batch(it)
            obs.on_backward()
            obs.on_loader_batch(it)
            obs.on_backward()
            obs.on_loader_batch(it)
            obs.on_backward()
            obs.on_optimizer_step()

    def noop(*_a) -> None:
        return None

    def bare(n: int) -> None:  # the same calls to a function that does nothing
        for _ in range(n):
            noop(it)
            noop()
            noop()

    def bare4(n: int) -> None:
        for _ in range(n):
            noop(it)
            noop()
            noop(it)
            noop()
            noop(it)
            noop()
            noop(it)
            noop()
            noop()

    def empty(n: int) -> None:
        for _ in range(n):
            pass

    step(2000)  # warm up
    results: dict[str, object] = {
        "steady_step_vs_empty_loop": paired(step, empty, args.rounds, args.steps),
        "steady_step_vs_noop_calls": paired(step, bare, args.rounds, args.steps),
    }
    # Four synchronized backwards per step, with the accumulation check kept from ever
    # concluding (so it counts and judges every step): the costliest per-step path.
    checks.ACCUMULATION_CONFIRM_STEPS = 1 << 60
    results["accumulate4_counting_step_vs_empty_loop"] = paired(step4, empty, args.rounds,
                                                                args.steps // 4)
    results["accumulate4_counting_step_vs_noop_calls"] = paired(step4, bare4, args.rounds,
                                                                args.steps // 4)

    # The first FIND_UNUSED_STEPS steps of a find_unused_parameters=True job also read
    # DDP's logging data once per step.
    unused = DDP(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)),
                 find_unused_parameters=True)
    unused(torch.randn(4, 64)).sum().backward()
    unused(torch.randn(4, 64)).sum().backward()
    results["find_unused_window_extra_us_per_step"] = once_us(unused._get_ddp_logging_data, 50)

    # Once per epoch: a new pass over the training loader (DistributedSampler epoch check).
    def new_pass() -> None:
        fresh = iter(loader)
        next(fresh)
        obs.on_loader_batch(fresh)
        obs.on_optimizer_step()

    def iterator_only() -> None:
        next(iter(loader))

    results["new_epoch_pass_us"] = round(once_us(new_pass, 50) - once_us(iterator_only, 50), 1)

    # One-off: inspections and the checksum of a ~10M-parameter model.
    torch.manual_seed(0)
    big = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(10)])  # 10.5M params, 20 tensors
    many = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.LayerNorm(256))
                           for _ in range(150)])  # 9.9M params, 600 tensors

    def full_sum(m) -> float:
        return sum(p.detach().sum(dtype=torch.float64).item() for p in m.parameters())

    results["one_off_us"] = {
        "inspect_model": once_us(lambda: checks.inspect_model(big, 2, 0, batch_size=8)),
        "inspect_loader": once_us(lambda: checks.inspect_loader(loader, 2, 0)),
        "param_checksum_10.5M_params_20_tensors": once_us(lambda: checks.param_checksum(big)),
        "param_checksum_9.9M_params_600_tensors": once_us(lambda: checks.param_checksum(many)),
        "full_float64_sum_10.5M_params_20_tensors": once_us(lambda: full_sum(big)),
        "full_float64_sum_9.9M_params_600_tensors": once_us(lambda: full_sum(many)),
    }
    results["config"] = {"rounds": args.rounds, "steps_per_block": args.steps,
                         "torch": torch.__version__, "python": sys.version.split()[0]}
    print(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
