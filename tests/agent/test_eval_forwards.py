"""Issue 40, item 8: evaluation forwards between training steps (`model.eval()` and
`torch.no_grad()` after an optimizer step, before the next step's forward). The agent
cannot tell them from a training forward when they run (a distillation teacher's
forward is no_grad and eval-mode too), so they are counted in the next step's `forward`
and the validation loader's fetches in its `dataloader`: the step that follows an
evaluation is long in forward, which is what the stall table reads as "evaluation or
logging on rank 0" (docs/diagnosis.md). docs/frameworks.md says so; this pins it: the
time is in forward, never in backward, sync or optimizer, and no step is added or lost."""

from __future__ import annotations

import time
from collections import deque

import torch
from torch import nn

from traceml_agent import hooks
from traceml_agent.recorder import BACKWARD, FORWARD, OPTIMIZER, SYNC, Recorder

EVAL_S = 0.2


class SlowEval(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            time.sleep(EVAL_S / 4)  # an evaluation batch's work
        return self.lin(x)


def test_an_evaluation_between_steps_is_in_the_next_steps_forward() -> None:
    rec = Recorder(deque())
    errors: list[BaseException] = []
    hooks.install(rec, torch, errors.append, None)
    try:
        model = SlowEval()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(4, 8)
        for step in range(6):
            if step == 4:  # an evaluation pass of 4 batches before the fifth step
                model.eval()
                with torch.no_grad():
                    for _ in range(4):
                        model(x)
                model.train()
            loss = model(x).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        hooks.uninstall()
    assert not errors and rec.step == 6
    phases = [acc for _, _, _, acc in rec.out]
    after = phases[4]  # the step that follows the evaluation
    assert after[FORWARD] >= EVAL_S * 1e9 * 0.9, after
    for idx in (BACKWARD, SYNC, OPTIMIZER):
        assert (after[idx] or 0) < EVAL_S * 1e9 / 4, (idx, after)
    assert all(acc[FORWARD] < EVAL_S * 1e9 / 4 for acc in phases[:4] + phases[5:]), phases
