"""The agent's host cost on a GPU: per CUDA event, per device phase, and per training step.

    python benchmarks/gpu_agent_cost.py                       # on a machine with a GPU
    python benchmarks/gpu_agent_cost.py --device cpu --rounds 3 --steps 100   # the harness

1. Per event, the agent's way: `CudaRecorder._event()`, the recorder's own code for one
   timing event (capture check, current device, the rank's current stream, an event
   from the pool recorded on it), timed over --events calls, beside a bare
   `Event.record()` on the same stream (CUDA's own floor).
2. Per device phase: `begin(forward)` + `end()` on a CudaRecorder, with a step closed
   (and earlier steps resolved with `query()`) every 8 phases, as a training step does.
3. Per step: a small MLP trained on the GPU in blocks of --steps, with the agent off and
   on (zero-code mode, `traceml_agent.init`, reporting to a real collector) in
   interleaved rounds, so machine noise hits both alike. The loop synchronizes only at
   the end of each block (the benchmark's own sync; the agent never does).

Host figures (the training thread's time): the agent's work is host work that runs
ahead of the GPU; a step whose host time is hidden behind its kernels pays nothing, so
the per-step figure is measured on a host-bound loop (small kernels), the worst case.
Prints each measurement and one JSON line at the end. Never run by CI (no GPU there):
tests/gpu/test_gpu_agent_cost.py runs it briefly in the GPU suite.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def per_event(torch: Any, index: int, n: int) -> dict[str, float]:
    """µs per event: the agent's `_event()` and a bare `record()` on the same stream."""
    from traceml_agent.recorder import CudaRecorder

    rec = CudaRecorder(deque(maxlen=16), torch, device=index)
    stream = torch.cuda.current_stream(index)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for ev in events:  # torch creates the CUDA event at its first record: not timed here
        ev.record(stream)
    torch.cuda.synchronize(index)  # the benchmark's own sync, before timing

    t0 = time.perf_counter_ns()
    for ev in events:
        ev.record(stream)
    bare = (time.perf_counter_ns() - t0) / n / 1000
    torch.cuda.synchronize(index)

    rec.pool = list(events)  # steady state: events come from the pool
    t0 = time.perf_counter_ns()
    for _ in range(n):
        rec._event()
    agent = (time.perf_counter_ns() - t0) / n / 1000
    torch.cuda.synchronize(index)
    return {"record_us": round(bare, 3), "agent_event_us": round(agent, 3)}


def per_phase(torch: Any, index: int, n: int) -> dict[str, float]:
    """µs per device phase (begin + end), steps closed and resolved every 8 phases."""
    from traceml_agent.recorder import FORWARD, CudaRecorder

    rec = CudaRecorder(deque(maxlen=4096), torch, device=index)
    x = torch.ones(16, device=f"cuda:{index}")
    torch.cuda.synchronize(index)
    t0 = time.perf_counter_ns()
    for i in range(n):
        if rec.begin(FORWARD):
            x.add_(1)  # one small kernel inside the phase, as a real one has many
            rec.end()
        if i % 8 == 7:
            rec.close_step()
    per = (time.perf_counter_ns() - t0) / n / 1000
    rec.flush()
    t0 = time.perf_counter_ns()
    for _ in range(n):
        x.add_(1)
    kernel = (time.perf_counter_ns() - t0) / n / 1000
    torch.cuda.synchronize(index)
    return {"phase_us": round(per - kernel, 3), "kernel_launch_us": round(kernel, 3),
            "steps_resolved": len(rec.out)}


def build(torch: Any, device: Any, dim: int):
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, dim, device=device)
    y = torch.randint(0, 10, (64,), device=device)
    return model, opt, x, y, nn.CrossEntropyLoss()


def block(torch: Any, n: int, model, opt, x, y, loss_fn) -> float:
    """µs of wall time per step over n steps, synchronized at the block's end only."""
    def sync() -> None:
        if x.is_cuda:
            torch.cuda.synchronize(x.device)

    sync()
    t0 = time.perf_counter_ns()
    for _ in range(n):
        loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    sync()
    return (time.perf_counter_ns() - t0) / n / 1000


def per_step(torch: Any, device: Any, rounds: int, steps: int, dim: int) -> dict[str, Any]:
    """Paired rounds of the same loop, agent off then on: the median difference per step."""
    from agent_overhead import start_collector

    import traceml_agent

    parts = build(torch, device, dim)
    block(torch, 50, *parts)  # warm up (cuBLAS handles, the allocator)
    run_dir = Path(tempfile.mkdtemp(prefix="traceml-gpu-bench-"))
    collector, endpoint = start_collector(run_dir)
    bare: list[float] = []
    agent: list[float] = []
    recorder = ""
    try:
        for r in range(rounds):
            bare.append(block(torch, steps, *parts))
            traceml_agent.init(endpoint=endpoint, run_name="gpu-bench")
            block(torch, 20, *parts)  # the agent learns the model and the device
            agent.append(block(torch, steps, *parts))
            recorder = type(traceml_agent._state["rec"]).__name__
            traceml_agent.shutdown()
            print(f"round {r:2d}: bare {bare[-1]:8.1f} us/step   agent {agent[-1]:8.1f} us/step"
                  f"   ({recorder})", flush=True)
    finally:
        collector.terminate()
        collector.wait(10)
    diffs = sorted(a - b for a, b in zip(agent, bare, strict=True))
    return {"bare_us": round(statistics.median(bare), 1),
            "agent_us": round(statistics.median(agent), 1),
            "overhead_us_median": round(statistics.median(diffs), 1),
            "overhead_us_range": [round(diffs[0], 1), round(diffs[-1], 1)],
            "recorder": recorder, "rounds": rounds, "steps_per_block": steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = p.parse_args()

    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"})
    import torch

    result: dict[str, Any] = {"torch": torch.__version__, "device": args.device}
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: try --device cpu for the harness alone")
        index = torch.cuda.current_device()
        torch.cuda.set_device(index)
        result["gpu"] = torch.cuda.get_device_name(index)
        result["per_event"] = per_event(torch, index, args.events)
        print(f"per event: {result['per_event']}", flush=True)
        result["per_phase"] = per_phase(torch, index, args.events)
        print(f"per phase: {result['per_phase']}", flush=True)
        device = torch.device("cuda", index)
    else:
        device = torch.device("cpu")
    result["per_step"] = per_step(torch, device, args.rounds, args.steps, args.dim)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
