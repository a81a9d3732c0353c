"""Issue 40, item 5: the agent holds the user's objects weakly, and follows the job from
one optimizer to the next. A script that trains one model, drops it and trains another
(an HPO loop, k-fold, pretraining then fine-tuning) must get the first model's memory
back with the agent attached, and the second optimizer must close the steps (else the
rank reads as not stepping). In process, with the hooks, the host recorder and the setup
observer installed as `traceml run` installs them (the real job: test_e2e_two_models)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from agent_installed import installed
from torch import nn

from traceml_agent import device, hooks
from traceml_agent.checks import StepObserver
from traceml_agent.recorder import BACKWARD, FORWARD, OPTIMIZER, SYNC, Recorder


@pytest.fixture
def agent() -> Iterator[tuple[Recorder, list[BaseException]]]:
    with installed(StepObserver(0, 1), maxlen=10_000) as (rec, errors, _):
        yield rec, errors


class Head(nn.Module):
    """A second model of another class (a head on a backbone, as fine-tuning builds)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    x = torch.randn(4, 8)
    for _ in range(steps):
        loss = model(x).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _first_model(steps: int = 5) -> tuple[Any, Any]:
    """Train a model and its Adam (state on every parameter) for `steps`; weak refs."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    opt = torch.optim.Adam(model.parameters())
    _train(model, opt, steps)
    return weakref.ref(model), weakref.ref(opt)


def test_a_dropped_model_and_its_optimizer_are_freed_with_the_agent_attached(agent):
    rec, errors = agent
    model_ref, opt_ref = _first_model()
    gc.collect()
    assert model_ref() is None, "the first model is still referenced"
    assert opt_ref() is None, "the first optimizer (and its Adam state) is still referenced"
    assert rec.step == 5 and not errors


def test_the_next_optimizer_closes_the_steps_once_the_first_is_gone(agent):
    rec, errors = agent
    _first_model(5)
    gc.collect()
    model = Head()  # another class: learned anew, its forward timed
    _train(model, torch.optim.SGD(model.parameters(), lr=0.01), 7)
    assert rec.step == 12 and not errors
    last = [acc for _, _, _, acc in list(rec.out)[-5:]]
    assert all(acc[FORWARD] is not None and acc[OPTIMIZER] is not None for acc in last), last
    # the backward/sync split's hook was learned on the new model's parameters too
    assert all(acc[BACKWARD] is not None and acc[SYNC] is not None for acc in last), last


def test_an_idle_optimizer_still_alive_yields_to_the_one_that_steps(agent):
    rec, errors = agent
    old = nn.Linear(8, 8)
    old_opt = torch.optim.SGD(old.parameters(), lr=0.01)
    _train(old, old_opt, 5)  # both kept alive (a results list, a scheduler), then idle
    model = Head()
    new_opt = torch.optim.SGD(model.parameters(), lr=0.01)
    _train(model, new_opt, 10)
    # the new optimizer's first RELEARN_OTHER_STEPS - 1 steps merge into its first one
    merged = hooks.RELEARN_OTHER_STEPS - 1
    assert rec.step == 5 + 10 - merged and not errors
    _train(old, old_opt, 6)  # the old one comes back: it is re-learned the same way
    assert rec.step == 5 + 10 - merged + 6 - merged
    del old_opt  # the step optimizer dropped: the next one to step takes over at once
    _train(model, new_opt, 4)
    assert rec.step == 5 + 10 - merged + 6 - merged + 4


def test_two_optimizers_stepping_in_turn_keep_the_first_as_the_step(agent):
    """A GAN: the generator's and the discriminator's optimizers step once each per
    iteration; the one that stepped first closes every step, for the whole run."""
    rec, errors = agent
    gen, disc = nn.Linear(8, 8), nn.Linear(8, 1)
    g_opt = torch.optim.SGD(gen.parameters(), lr=0.01)
    d_opt = torch.optim.SGD(disc.parameters(), lr=0.01)
    x = torch.randn(4, 8)
    for _ in range(12):
        d_opt.zero_grad()
        disc(gen(x).detach()).mean().backward()
        d_opt.step()
        g_opt.zero_grad()
        (-disc(gen(x)).mean()).backward()
        g_opt.step()
    assert rec.step == 12 and not errors


def test_the_recorders_device_sources_are_weak_and_bounded(agent):
    rec, _ = agent
    for _ in range(3 * device.MAX_SOURCES):
        _first_model(1)
    gc.collect()
    assert 0 < len(rec.device_sources) <= device.MAX_SOURCES
    assert all(isinstance(ref, weakref.ref) for ref in rec.device_sources)
    assert device.live(rec.device_sources) == []  # every model trained so far was dropped
