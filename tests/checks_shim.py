"""Runs a training script with a checks.StepObserver wired in by hand (tests only).

    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        tests/checks_shim.py OUT_DIR SCRIPT [ARGS...]

The agent's hooks (agent/hooks.py) are to make these same calls; until they do, this
shim makes them with the plainest patches, so the example scripts in
examples/mistakes/ can be checked end to end. When the script exits, each rank writes
OUT_DIR/rank<R>.json: its findings, its facts for the cross-rank checks, and the
observer's error if it turned itself off.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import socket
import sys
from pathlib import Path

import torch
from torch.nn.modules import module as nn_module
from torch.optim import optimizer as optim_module
from torch.utils.data import dataloader

from traceml_agent.checks import StepObserver


def install(obs: StepObserver) -> None:
    original_next = dataloader._BaseDataLoaderIter.__next__

    def __next__(self):
        batch = original_next(self)
        obs.on_loader_batch(self)
        return batch

    dataloader._BaseDataLoaderIter.__next__ = __next__

    depth = [0]  # only the outermost module call is a root (the DDP wrapper, not its layers)

    def pre(module, args):
        if depth[0] == 0:
            obs.watch_model(module)
        depth[0] += 1

    def post(module, args, output):
        depth[0] -= 1

    nn_module.register_module_forward_pre_hook(pre)
    nn_module.register_module_forward_hook(post, always_call=True)

    original_backward = torch.autograd.backward

    def backward(*args, **kwargs):
        try:
            return original_backward(*args, **kwargs)
        finally:
            obs.on_backward()

    torch.autograd.backward = backward
    optim_module.register_optimizer_step_post_hook(lambda *a: obs.on_optimizer_step())


def main() -> None:
    out_dir, script = Path(sys.argv[1]), sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    obs = StepObserver(rank, world)
    install(obs)

    def report() -> None:
        doc = {"rank": rank, "host": socket.gethostname(),
               "findings": [f.to_wire() for f in obs.drain()], "facts": obs.take_facts(),
               "error": None if obs.error is None else repr(obs.error)}
        (out_dir / f"rank{rank}.json").write_text(json.dumps(doc))

    atexit.register(report)
    sys.argv = [script, *sys.argv[3:]]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
