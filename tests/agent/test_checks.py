"""The setup-mistake checks (agent/checks.py) on real torch objects, in one process.

A gloo group of world size 1 makes real DDP modules; checks that depend on the world
size are given world_size=2 explicitly, with samplers built for rank 0 of 2. The
observer is driven the way the agent's hooks will drive it (`drive` below), so each
test asserts what the observer really saw in a real training loop.
"""

from __future__ import annotations

import math
import subprocess
import sys
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from traceml_agent import checks, findings
from traceml_agent.checks import (
    ACCUMULATION_CONFIRM_STEPS,
    FIND_UNUSED_STEPS,
    StepObserver,
    inspect_batchnorm,
    inspect_loader,
    inspect_model,
    param_checksum,
)
from traceml_agent.findings import Finding, facts_from_wire
from traceml_agent.vocab import format_ranks
from traceml_tui.judge.setup_checks import compare_checksums, compare_devices, merge_findings

WORLD = 2  # the world size the checks are told about


@pytest.fixture(scope="module", autouse=True)
def group(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def data(n: int = 128) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g))


def net(bn: bool = False, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers = [nn.Linear(8, 16)] + ([nn.BatchNorm1d(16)] if bn else []) + [nn.ReLU(),
                                                                          nn.Linear(16, 4)]
    return nn.Sequential(*layers)


def dist_loader(n: int = 128, batch: int = 16, shuffle: bool = True, **kw) -> DataLoader:
    ds = data(n)
    return DataLoader(ds, batch_size=batch,
                      sampler=DistributedSampler(ds, num_replicas=WORLD, rank=0, shuffle=shuffle),
                      **kw)


def drive(obs: StepObserver, model: nn.Module, loader: DataLoader, *, epochs: int = 1,
          max_steps: int | None = None, accumulate: int = 1, no_sync: bool = False,
          set_epoch: bool = True) -> int:
    """A training loop calling the observer where the agent's hooks will: watch_model at
    the first forward, on_loader_batch after each batch, on_backward after each backward,
    on_optimizer_step after each optimizer step. Returns the optimizer steps taken."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    steps, watched = 0, False
    for epoch in range(epochs):
        if set_epoch and isinstance(loader.sampler, DistributedSampler):
            loader.sampler.set_epoch(epoch)
        it = iter(loader)
        while max_steps is None or steps < max_steps:
            micro = []
            for batch in it:
                obs.on_loader_batch(it, batch)
                micro.append(batch)
                if len(micro) == accumulate:
                    break
            if len(micro) < accumulate:
                break
            for i, (x, y) in enumerate(micro):
                if not watched:
                    obs.watch_model(model)
                    watched = True
                quiet = no_sync and i < accumulate - 1
                with model.no_sync() if quiet else nullcontext():
                    nn.functional.cross_entropy(model(x), y).backward()
                obs.on_backward()
            opt.step()
            obs.on_optimizer_step()
            opt.zero_grad()
            steps += 1
    return steps


def ids(findings: list[Finding]) -> list[str]:
    return [f.id for f in findings]


# --- the clean configuration ---------------------------------------------------------------


def test_clean_configuration_produces_no_findings():
    model = DDP(net())
    loader = dist_loader()  # 128 samples, 64 per rank, 4 batches of 16
    assert inspect_model(model, WORLD, 0, batch_size=16) == []
    assert inspect_loader(loader, WORLD, 0) == []
    obs = StepObserver(rank=0, world_size=WORLD)
    before = param_checksum(model)
    assert drive(obs, model, loader, epochs=4) == 16
    assert obs.drain() == []
    assert obs.error is None
    facts = obs.take_facts()
    # taken before any update; the batch size is for samples/s
    assert facts == {"param_checksum": before, "device": None, "batch_size": loader.batch_size,
                     "batch_digest": facts["batch_digest"], "dataset_digest": None,
                     "sampler": None}
    assert len(facts["batch_digest"]) == 16
    assert obs.take_facts() is None  # sent once


# --- model inspectors ------------------------------------------------------------------------


def test_data_parallel_is_critical_across_processes_and_a_warning_in_one():
    dp = nn.DataParallel(net())
    [f] = inspect_model(dp, world_size=WORLD, rank=1)
    assert (f.id, f.severity, f.ranks) == ("data-parallel", "critical", (1,))
    assert "2 processes" in f.evidence
    [f1] = inspect_model(dp, world_size=1)
    assert f1.severity == "warning"
    assert inspect_model(DDP(net()), WORLD) == []
    obs = StepObserver(0, WORLD)
    drive(obs, dp, dist_loader(), max_steps=2)
    assert ids(obs.drain()) == ["data-parallel"]


@pytest.mark.parametrize("batch, bn, mode, world, fires", [
    (8, True, "train", WORLD, True),
    (15, True, "train", WORLD, True),
    (16, True, "train", WORLD, False),  # at the threshold: per-rank statistics are fine
    (8, True, "eval", WORLD, False),  # frozen BatchNorm uses running statistics
    (8, True, "train", 1, False),  # one process: nothing to synchronize
    (8, False, "train", WORLD, False),
    (8, "sync", "train", WORLD, False),
])
def test_batchnorm_without_sync_at_small_per_rank_batch(batch, bn, mode, world, fires):
    model = net(bn=bool(bn))
    if bn == "sync":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.train(mode == "train")
    found = inspect_batchnorm(model, batch, world)
    assert ids(found) == (["batchnorm-not-synced"] if fires else [])
    if fires:
        assert f"over {batch} samples per rank" in found[0].evidence
        assert "BatchNorm1d x1" in found[0].evidence


def test_observer_checks_batchnorm_with_the_training_loaders_batch_size():
    obs = StepObserver(0, WORLD)
    drive(obs, DDP(net(bn=True)), dist_loader(batch=8), max_steps=2)
    [f] = obs.drain()
    assert f.id == "batchnorm-not-synced" and "over 8 samples per rank" in f.evidence


# --- loader inspectors ------------------------------------------------------------------------


def test_no_distributed_sampler_fires_only_with_several_ranks():
    loader = DataLoader(data(128), batch_size=16, shuffle=True)
    [f] = inspect_loader(loader, WORLD, 0)
    # A hint from one rank: only the ranks' data digests can prove it (test_same_data).
    assert (f.id, f.severity) == ("no-distributed-sampler", "info")
    assert f.evidence == "RandomSampler over all 128 samples on each of 2 ranks, no " \
                         "DistributedSampler"
    assert inspect_loader(loader, 1, 0) == []
    sequential = DataLoader(data(128), batch_size=16)
    assert ids(inspect_loader(sequential, WORLD, 0)) == ["no-distributed-sampler"]


def test_the_observer_inspects_the_loader_that_feeds_the_steps():
    obs = StepObserver(0, WORLD)
    drive(obs, DDP(net()), DataLoader(data(128), batch_size=16, shuffle=True), epochs=2)
    assert ids(obs.drain()) == ["no-distributed-sampler"]


@pytest.mark.parametrize("replicas, sampler_rank, rank", [(2, 0, 1), (4, 1, 1), (1, 0, 0)])
def test_sampler_built_for_another_rank_or_world(replicas, sampler_rank, rank):
    ds = data(128)
    loader = DataLoader(ds, batch_size=16,
                        sampler=DistributedSampler(ds, num_replicas=replicas, rank=sampler_rank))
    [f] = inspect_loader(loader, WORLD, rank)
    assert f.id == "sampler-shard-mismatch"
    assert f.evidence == f"rank {rank} of 2 reads shard {sampler_rank} of {replicas} " \
                         "(DistributedSampler num_replicas/rank)"


@pytest.mark.parametrize("n, sampler_drop_last, expect", [
    (321, False, ("info", 1)),  # 1 duplicate in 321: 0.3%
    (11, False, ("warning", 1)),  # 1 duplicate in 11: 9%
    (321, True, None),
    (320, False, None),
])
def test_uneven_shards_padded_by_the_sampler(n, sampler_drop_last, expect):
    ds = data(n)
    sampler = DistributedSampler(ds, num_replicas=WORLD, rank=0, drop_last=sampler_drop_last)
    loader = DataLoader(ds, batch_size=1, sampler=sampler)
    found = inspect_loader(loader, WORLD, 0)
    if expect is None:
        assert found == []
    else:
        [f] = found
        assert (f.id, f.severity) == ("uneven-shards", expect[0])
        assert f"repeats {expect[1]} sample(s) per epoch ({(n + 1) // 2} per rank)" in f.evidence


def test_partial_final_batch_unless_drop_last():
    found = inspect_loader(dist_loader(n=128, batch=24), WORLD, 0)
    assert [(f.id, f.evidence) for f in found] == [
        ("partial-final-batch", "64 samples per rank make 2 batches of 24 and a last batch of 16")]
    assert inspect_loader(dist_loader(n=128, batch=24, drop_last=True), WORLD, 0) == []


def test_iterable_datasets_and_iterators():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(10))

    assert inspect_loader(DataLoader(Stream(), batch_size=2), WORLD, 0) == []
    loader = DataLoader(data(128), batch_size=24, shuffle=True)
    assert inspect_loader(iter(loader), WORLD, 0) == inspect_loader(loader, WORLD, 0)
    assert ids(inspect_loader(loader, WORLD, 0)) == ["no-distributed-sampler",
                                                     "partial-final-batch"]


# --- set_epoch --------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 1])
def test_set_epoch_never_called_is_seen_at_the_second_epoch(workers):
    obs = StepObserver(0, WORLD)
    model = DDP(net())
    # persistent workers reuse one iterator object across epochs
    loader = dist_loader(num_workers=workers, persistent_workers=workers > 0)
    drive(obs, model, loader, epochs=1, set_epoch=False)
    assert obs.drain() == []  # one epoch is no evidence
    drive(obs, model, loader, epochs=2, set_epoch=False)
    [f] = obs.drain()
    assert (f.id, f.severity) == ("set-epoch-not-called", "warning")
    assert f.evidence == "pass 2 over the DistributedSampler started with epoch=0, as did " \
                         "pass 1: the same sample order again"


def test_set_epoch_called_or_no_shuffle_is_fine():
    obs = StepObserver(0, WORLD)
    drive(obs, DDP(net()), dist_loader(), epochs=3, set_epoch=True)
    drive(obs, DDP(net()), dist_loader(shuffle=False), epochs=3, set_epoch=False)
    assert obs.drain() == []


def test_a_validation_loop_between_epochs_is_not_a_training_pass():
    obs = StepObserver(0, WORLD)
    model, train, val = DDP(net()), dist_loader(), dist_loader(shuffle=True)
    for epoch in range(3):
        train.sampler.set_epoch(epoch)
        drive(obs, model, train, epochs=1, set_epoch=False)
        with torch.no_grad():  # val's sampler never gets set_epoch: it feeds no step
            it = iter(val)
            for x, _ in it:
                obs.on_loader_batch(it)
                model(x)
    assert obs.drain() == []


def test_two_loaders_taking_turns_within_an_epoch_are_two_passes_not_many():
    obs = StepObserver(0, WORLD)
    model = DDP(net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loaders = dist_loader(), dist_loader(n=256)
    obs.watch_model(model)
    for epoch in range(3):
        for loader in loaders:
            loader.sampler.set_epoch(epoch)
        iters = [iter(loader) for loader in loaders]
        for batches in zip(*iters, strict=False):  # a step from each loader in turn
            for it, (x, y) in zip(iters, batches, strict=True):
                obs.on_loader_batch(it)
                nn.functional.cross_entropy(model(x), y).backward()
                obs.on_backward()
                opt.step()
                obs.on_optimizer_step()
    assert obs.drain() == []


# --- gradient accumulation ------------------------------------------------------------------


def test_accumulation_without_no_sync_allreduces_every_micro_batch():
    obs = StepObserver(0, WORLD)
    model = DDP(net())
    drive(obs, model, dist_loader(n=512), max_steps=ACCUMULATION_CONFIRM_STEPS - 1, accumulate=4)
    assert obs.drain() == []
    drive(obs, model, dist_loader(n=512), max_steps=1, accumulate=4)
    [f] = obs.drain()
    assert (f.id, f.severity) == ("accumulation-without-no-sync", "warning")
    assert f.evidence == "4 backward passes per optimizer step each allreduced all gradients " \
                         "(3 steps in a row): 3 of every 4 allreduces wasted"


def test_accumulation_with_no_sync_is_fine():
    obs = StepObserver(0, WORLD)
    drive(obs, DDP(net()), dist_loader(n=512), max_steps=8, accumulate=4, no_sync=True)
    assert obs.drain() == []


def test_no_sync_around_backward_only_still_synchronizes():
    """DDP decides at forward time: a forward outside no_sync() allreduces in backward."""
    obs = StepObserver(0, WORLD)
    model = DDP(net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    obs.watch_model(model)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    for _ in range(ACCUMULATION_CONFIRM_STEPS):
        for i in range(2):
            loss = nn.functional.cross_entropy(model(x), y)
            with model.no_sync() if i == 0 else nullcontext():
                loss.backward()
            obs.on_backward()
        opt.step()
        obs.on_optimizer_step()
    assert ids(obs.drain()) == ["accumulation-without-no-sync"]


# --- find_unused_parameters -----------------------------------------------------------------


class Branchy(nn.Module):
    """`b` is used on every step but every `skip_every`-th (never skipped when 0)."""

    def __init__(self, skip_every: int = 0, never_b: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)
        self.skip_every, self.never_b, self.calls = skip_every, never_b, 0

    def forward(self, x):
        self.calls += 1
        h = self.a(x)
        skip = self.never_b or (self.skip_every and self.calls % self.skip_every == 0)
        return self.head(h if skip else self.b(h))


@pytest.mark.parametrize("module, find_unused, fires", [
    (Branchy(), True, True),
    (Branchy(never_b=True), True, False),  # the flag is needed
    (Branchy(skip_every=3), True, False),  # a dynamic graph: needed every third step
    (Branchy(), False, False),
])
def test_find_unused_parameters_on_a_graph_without_unused_parameters(module, find_unused, fires):
    obs = StepObserver(0, WORLD)
    model = DDP(module, find_unused_parameters=find_unused)
    drive(obs, model, dist_loader(n=1024), max_steps=FIND_UNUSED_STEPS - 1)
    assert obs.drain() == []  # not conclusive yet
    drive(obs, model, dist_loader(n=1024), max_steps=10)
    found = obs.drain()
    assert ids(found) == (["find-unused-parameters-unneeded"] if fires else [])
    if fires:
        assert "found 0 unused parameters in each of 10 iterations" in found[0].evidence


# --- parameter checksum ---------------------------------------------------------------------


def test_param_checksum_equal_weights_equal_values():
    a, b, c = net(seed=0), net(seed=0), net(seed=1)
    assert param_checksum(a) == param_checksum(b) == param_checksum(DDP(b))
    assert not math.isclose(param_checksum(a), param_checksum(c), rel_tol=1e-6)
    assert param_checksum(nn.ReLU()) is None
    big = nn.Linear(1000, 1000)  # 1M weights: only strided samples are read
    before = param_checksum(big)
    with torch.no_grad():
        big.weight.mul_(1.01)
    assert param_checksum(big) != before


def test_facts_wait_for_the_first_optimizer_step():
    """Roots are learned during the first step, so facts sent earlier could miss one."""
    obs = StepObserver(0, WORLD)
    model = DDP(net())
    initial = param_checksum(model)
    obs.watch_model(model)
    assert obs.take_facts() is None
    model(torch.randn(2, 8)).sum().backward()
    obs.on_backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    obs.on_optimizer_step()
    assert param_checksum(model) != initial  # the step changed the weights...
    assert obs.take_facts()["param_checksum"] == initial  # ...not the facts


def test_ranks_with_different_weights_are_found_by_comparing_facts():
    """Two observers standing in for two ranks; rank 1 loaded other weights after DDP."""
    facts = {}
    for rank, seed in ((0, 0), (1, 7)):
        obs = StepObserver(rank, WORLD)
        model = DDP(net())
        model.module.load_state_dict(net(seed=seed).state_dict())
        drive(obs, model, dist_loader(), max_steps=1)
        facts[rank] = obs.take_facts()["param_checksum"]
    f = compare_checksums(facts)
    assert (f.id, f.severity, f.ranks) == ("params-differ-across-ranks", "critical", (1,))
    assert f"{facts[1]:.9g} on rank 1 vs {facts[0]:.9g} on rank(s) 0" in f.evidence


# --- cross-rank comparisons (no torch needed) ------------------------------------------------

NAN = float("nan")


@pytest.mark.parametrize("per_rank, odd", [
    ({}, None),
    ({0: 1.5}, None),
    ({0: 1.5, 1: 1.5, 2: 1.5}, None),
    ({0: 1.5, 1: 1.5 * (1 + 1e-12)}, None),  # summation-order noise
    ({0: 1.5, 1: 2.5, 2: 1.5, 3: 1.5}, (1,)),
    ({0: 9.0, 1: 1.5, 2: 1.5, 3: 1.5}, (0,)),  # rank 0 is the odd one out
    ({0: 1.5, 1: 2.5}, (1,)),  # a tie: rank 0's group is the reference
    ({0: 1.5, 1: 2.5, 2: 3.5}, (1, 2)),
    ({0: NAN, 1: NAN}, None),
    ({0: 1.5, 1: NAN, 2: 1.5}, (1,)),
    ({0: 1.5, 1: None, 2: 2.5}, (2,)),
])
def test_compare_checksums(per_rank, odd):
    f = compare_checksums(per_rank)
    assert (f and f.ranks) == odd
    if f:
        assert f.id == "params-differ-across-ranks"
        assert f"{len(odd)} of {sum(v is not None for v in per_rank.values())} ranks differ" \
            in f.evidence


@pytest.mark.parametrize("per_rank, shared, evidence", [
    ({0: ("h", None), 1: ("h", None)}, None, None),  # CPU
    ({0: ("h", "GPU-a"), 1: ("h", "GPU-b")}, None, None),
    ({0: ("h", "cuda:0"), 1: ("g", "cuda:0")}, None, None),  # same index, other hosts
    ({0: ("h", "GPU-a"), 1: ("h", "GPU-a"), 2: ("h", "GPU-b")}, (0, 1),
     "ranks 0-1 all run on GPU-a of host h"),
    ({0: ("h", "GPU-a"), 1: ("h", "GPU-b"), 2: ("h", "GPU-a"), 3: ("h", "GPU-b")},
     (0, 1, 2, 3), "ranks 0,2 all run on GPU-a of host h; 1 more shared device(s)"),
])
def test_compare_devices(per_rank, shared, evidence):
    f = compare_devices(per_rank)
    assert (f and f.ranks) == shared
    if f:
        assert (f.id, f.severity, f.evidence) == ("same-device", "critical", evidence)


def _f(fid: str, rank: int, evidence: str = "e", severity: str = "warning") -> Finding:
    return Finding(fid, severity, (rank,), evidence, "fix")


@pytest.mark.parametrize("findings, world, expect", [
    ([], None, []),
    ([_f("x", 1), _f("x", 0)], None, [("x", "warning", (0, 1), "e")]),
    ([_f("x", 0, "a"), _f("x", 1, "b")], None,
     [("x", "warning", (0, 1), "rank 0: a (other ranks: other numbers)")]),
    ([_f("x", 0, severity="info"), _f("x", 1, severity="critical")], None,
     [("x", "critical", (0, 1), "e")]),
    ([_f("a-info", 0, severity="info"), _f("z-crit", 0, severity="critical")], None,
     [("z-crit", "critical", (0,), "e"), ("a-info", "info", (0,), "e")]),
    ([_f(checks.FIND_UNUSED_UNNEEDED, 0)], 2, []),  # rank 1 may need the flag
    ([_f(checks.FIND_UNUSED_UNNEEDED, 0), _f(checks.FIND_UNUSED_UNNEEDED, 1)], 2,
     [(checks.FIND_UNUSED_UNNEEDED, "warning", (0, 1), "e")]),
    ([_f(checks.FIND_UNUSED_UNNEEDED, 0)], None, [(checks.FIND_UNUSED_UNNEEDED, "warning",
                                                   (0,), "e")]),
])
def test_merge_findings(findings, world, expect):
    merged = merge_findings(findings, world_size=world)
    assert [(f.id, f.severity, f.ranks, f.evidence) for f in merged] == expect


@pytest.mark.parametrize("ranks, text", [
    ([], ""), ([3], "3"), ([0, 1, 2, 3], "0-3"), ([5, 0, 1, 3, 7, 8, 9], "0-1,3,5,7-9"),
])
def test_format_ranks(ranks, text):
    assert format_ranks(ranks) == text


def test_wire_round_trip_and_validation():
    f = checks.finding("uneven-shards", (3,), "x" * 500)
    wire = f.to_wire()
    assert len(wire["evidence"]) == findings.MAX_TEXT and wire["ranks"] == [3]
    assert Finding.from_wire(wire) == f
    for bad in (None, {**wire, "extra": 1}, {**wire, "severity": "bad"},
                {**wire, "ranks": [-1]}, {**wire, "ranks": "0"}, {**wire, "fix": "y" * 201}):
        with pytest.raises(ValueError):
            Finding.from_wire(bad)
    none = {"batch_digest": None, "dataset_digest": None, "sampler": None}
    assert facts_from_wire({"param_checksum": 3, "device": None}) == {
        "param_checksum": 3.0, "device": None, "batch_size": None, **none}
    assert facts_from_wire({"param_checksum": None, "device": None, "batch_size": 32}) == {
        "param_checksum": None, "device": None, "batch_size": 32, **none}
    data = {"batch_digest": "ab" * 8, "dataset_digest": None, "sampler": "RandomSampler"}
    assert facts_from_wire({"param_checksum": None, "device": None, **data}) == {
        "param_checksum": None, "device": None, "batch_size": None, **data}
    for bad in ({"param_checksum": "3", "device": None}, {"param_checksum": 1.0},
                {"param_checksum": 1.0, "device": "d" * 129},
                {"param_checksum": 1.0, "device": None, "batch_size": 0},
                {"param_checksum": 1.0, "device": None, "batch_size": True},
                {"param_checksum": 1.0, "device": None, "batch_size": 2.5},
                {"param_checksum": 1.0, "device": None, "batch_digest": 3},
                {"param_checksum": 1.0, "device": None, "sampler": "s" * 65}):
        with pytest.raises(ValueError):
            facts_from_wire(bad)


# --- never raising into user code -------------------------------------------------------------


def test_odd_objects_never_raise():
    assert inspect_model(object(), WORLD) == []
    assert inspect_loader(object(), WORLD) == []
    assert inspect_batchnorm(object(), 4, WORLD) == []
    assert param_checksum(object()) is None
    obs = StepObserver(0, WORLD)
    obs.on_loader_batch(object())  # not a DataLoader iterator
    obs.on_backward()
    obs.on_optimizer_step()
    assert isinstance(obs.error, AttributeError)  # it turned itself off...
    obs.watch_model(DDP(net()))
    obs.on_optimizer_step()  # ...and stays off
    assert obs.drain() == [] and obs.take_facts() is None


def test_importing_checks_imports_neither_torch_nor_textual():
    code = ("import sys, traceml_agent.checks; "
            "print(sorted(m for m in ('torch', 'textual') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
