"""A whole training step captured in one CUDA graph and replayed: PyTorch's documented
whole-network capture (torch.cuda.graphs, "Whole-network capture"), as Megatron/NeMo
full-iteration graphs and torch.compile(mode="reduce-overhead") do it.

Warm-up steps on a side stream, then forward, backward and optimizer.step() captured
into one graph (capture mode --mode, PyTorch's default "global": any prohibited CUDA
call from any thread, an event query say, invalidates the capture and the `with
torch.cuda.graph` block raises in this script), then `static_x.copy_(batch);
g.replay()` for --seconds: no module call, no backward, no optimizer.step() in Python.
Batches come from tensors already on the GPU (--source tensors: nothing at all of the
step is visible to hooks) or from a DataLoader (--source loader).

Prints "capture ok" after the capture, and the loss before and after the replays (it
falls: the replays train). Knows nothing about traceml.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from rank_device import rank_device


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--warmup", type=int, default=5, help="eager steps before the capture")
    p.add_argument("--seconds", type=float, default=8.0, help="how long to replay")
    p.add_argument("--min-replays", type=int, default=50)
    p.add_argument("--mode", choices=("global", "thread_local", "relaxed"), default="global")
    p.add_argument("--source", choices=("tensors", "loader"), default="tensors")
    # Big enough for a step of a few ms on a large GPU: replays then come at the rate of
    # real training steps, not tens of thousands a second.
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=4096)
    args = p.parse_args()

    device = rank_device()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.dim, args.hidden), nn.ReLU(),
                          nn.Linear(args.hidden, args.hidden), nn.ReLU(),
                          nn.Linear(args.hidden, 1)).to(device)
    # Plain SGD is capturable as it is (Adam would need capturable=True).
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.MSELoss()
    truth = torch.randn(args.dim, 1, device=device) / args.dim**0.5

    def batch_on_gpu() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(args.batch, args.dim, device=device)
        return x, x @ truth

    static_x, static_y = batch_on_gpu()

    # Warm up on a side stream (the documented pattern): the first steps allocate the
    # optimizer's state and autograd's buffers outside the graph.
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(args.warmup):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(static_x), static_y)
            loss.backward()
            opt.step()
    torch.cuda.current_stream(device).wait_stream(side)

    # The whole step in one graph. Gradients set to None first, so backward allocates
    # them from the graph's private pool (static across replays).
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph, capture_error_mode=args.mode):
        static_loss = loss_fn(model(static_x), static_y)
        static_loss.backward()
        opt.step()
    print(f"capture ok (mode {args.mode})", flush=True)

    if args.source == "loader":
        xs = torch.randn(args.batch * 16, args.dim)
        data = TensorDataset(xs, xs @ truth.cpu())
        loader = DataLoader(data, batch_size=args.batch, shuffle=True, drop_last=True,
                            pin_memory=True)

        def batches():
            while True:
                yield from loader
    else:
        pool = [batch_on_gpu() for _ in range(8)]

        def batches():
            while True:
                yield from pool

    graph.replay()
    first = static_loss.item()
    replays, end = 1, time.monotonic() + args.seconds
    for x, y in batches():
        static_x.copy_(x, non_blocking=True)
        static_y.copy_(y, non_blocking=True)
        graph.replay()
        replays += 1
        if replays >= args.min_replays and time.monotonic() >= end:
            break
    last = static_loss.item()
    print(f"replayed {replays} times: loss {first:.4f} -> {last:.4f}", flush=True)
    if not last < first:
        raise SystemExit("the replays did not train: the captured step is not the step")


if __name__ == "__main__":
    main()
