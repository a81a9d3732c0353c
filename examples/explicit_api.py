"""The agent's explicit API, for loops the zero-code hooks cannot see.

This loop has no DataLoader, no nn.Module call and no torch.optim optimizer: it
builds batches by hand, averages gradients with its own all_reduce and updates
the weights itself. `traceml_agent.step()` marks each step and
`traceml_agent.phase(name)` times each part; a custom name ("augment") becomes a
phase of its own.

Under traceml run (the agent is already started, init() is a no-op):
    traceml run examples/explicit_api.py --nproc-per-node 2 --headless

Without traceml run: start a collector, then the ranks with its address:
    traceml collector --run-dir runs/manual --world-size 2 --exit-when-done &
    TRACEML_ENDPOINT=tcp://127.0.0.1:PORT torchrun --nproc-per-node 2 examples/explicit_api.py
"""

import argparse
import time

import torch
import torch.distributed as dist

import traceml_agent


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    traceml_agent.init()  # reads TRACEML_ENDPOINT; harmless when traceml run started it
    world = dist.get_world_size()
    w = torch.zeros(128, 10, requires_grad=True)
    for _ in range(args.steps):
        with traceml_agent.step():
            with traceml_agent.phase("dataloader"):
                x, y = torch.randn(64, 128), torch.randint(0, 10, (64,))
            with traceml_agent.phase("augment"):
                x = x + 0.01 * torch.randn_like(x)
                time.sleep(0.002)
            with traceml_agent.phase("forward"):
                loss = torch.nn.functional.cross_entropy(x @ w, y)
            with traceml_agent.phase("backward"):
                loss.backward()
            with traceml_agent.phase("sync"):
                dist.all_reduce(w.grad)
            with traceml_agent.phase("optimizer"):
                with torch.no_grad():
                    w -= 0.1 * w.grad / world
                    w.grad = None
    traceml_agent.shutdown()
    # Leave together: a rank tearing gloo down while another still sends can abort
    # ("terminate called without an active exception") on this torch build.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
