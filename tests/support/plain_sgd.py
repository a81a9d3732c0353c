"""An optimizer whose step Dynamo can trace whole, for the compiled-step tests (the CPU
one in tests/agent/ and the GPU job in tests/gpu/jobs/): torch's own optimizers wrap their
step in graph breaks of their own, so fullgraph=True fails for them with or without the
agent; with this one the step hooks torch calls around it are traced with it."""

from __future__ import annotations

import torch


class PlainSGD(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])
