"""Do post-accumulate-grad hooks fire on FSDP2's sharded (DTensor) parameters? The agent's
backward/sync boundary (hooks.py: autograd's last gradient) is such a hook. Prints one
line per rank: the parameters' type, hook calls and parameters (tests/e2e/test_e2e_fsdp.py)."""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

STEPS = 3

dist.init_process_group("gloo")
model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
for layer in model:
    if isinstance(layer, nn.Linear):
        fully_shard(layer)
fully_shard(model)
calls: list[str] = []
params = list(model.named_parameters())
for name, p in params:
    p.register_post_accumulate_grad_hook(lambda _p, name=name: calls.append(name))
for _ in range(STEPS):
    model(torch.randn(4, 8)).sum().backward()
print(f"rank {dist.get_rank()}: {type(params[0][1]).__name__} {len(calls)} calls "
      f"{len(params) * STEPS} expected", flush=True)
dist.barrier()
# Out at once: torch's own teardown of FSDP's threads at interpreter exit aborted once
# ("terminate called without an active exception", fresh-clone run 8), a race of torch's
# that is not what this checks.
os._exit(0)
