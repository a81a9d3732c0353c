"""Setup mistakes of a DDP job, detected from inside the running job.

A DDP job with a setup mistake usually runs without an error: it trains every rank
on the same data, repeats one epoch's order forever, or allreduces four times per
step. This module finds those mistakes from the objects the agent already sees (the
root module, the DataLoader iterator, the optimizer step) and says so once, with the
numbers it saw and the fix. docs/checks.md lists each check and its false positives.

Three layers, so each runs where its evidence is:

- start-of-run inspectors (`inspect_model`, `inspect_loader`, `param_checksum`) take
  the real objects and run once: they may walk modules, never on the per-step path;
- `StepObserver` is called by the agent's hooks on every batch, backward and optimizer
  step, costs well under a microsecond per call once the one-off checks are done, and
  reports a finding only when its evidence is conclusive;
- cross-rank comparisons (`compare_checksums`, `compare_devices`, `merge_findings`,
  in traceml_tui/judge/setup_checks.py) run in the collector, on values every rank
  sent: a mistake that is only visible across
  ranks is never found with a collective of our own, which could hang or reorder
  the job's collectives.

Rules kept because this runs inside someone's training process: torch is imported
lazily inside functions (importing this module imports neither torch nor textual),
nothing here raises into user code (public functions swallow their own errors; an
observer that fails turns itself off and keeps the error in `.error`), and nothing
on the per-step path synchronizes a GPU.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections import Counter, deque
from collections.abc import Callable
from typing import Any, TypeVar

from . import visible_devices
from .datadigest import BatchDigest, dataset_digest
from .findings import (  # the words the detectors share with the wire and the collector
    ACCUMULATION_WITHOUT_NO_SYNC,
    BATCHNORM_NOT_SYNCED,
    DATA_PARALLEL,
    FIND_UNUSED_UNNEEDED,
    NO_DISTRIBUTED_SAMPLER,
    PARTIAL_FINAL_BATCH,
    SAMPLER_SHARD_MISMATCH,
    SET_EPOCH_NOT_CALLED,
    UNEVEN_SHARDS,
    Finding,
    finding,
)
from .vocab import INFO, WARNING

# --- thresholds, and why ------------------------------------------------------------------

# BatchNorm normalises with the batch's own mean and variance. Below 16 samples per rank
# those estimates are noisy enough to hurt accuracy (the Group Normalization paper, Wu &
# He 2018, shows BatchNorm's ImageNet error rising quickly below 16 per GPU; the DDP guide
# this check comes from gives the same line: SyncBatchNorm under 16, plain BN fine >= 32).
SMALL_BN_BATCH = 16

# DDP's logger records the unused parameters of each of its first 10 iterations (then one
# iteration in 100), so 10 optimizer steps is all the evidence reading it can give early.
FIND_UNUSED_STEPS = 10

# One step with two synchronized backward passes can be a one-off (a retried batch, an
# extra loss on a warm-up step); three steps in a row is a loop that accumulates.
ACCUMULATION_CONFIRM_STEPS = 3

# DistributedSampler(drop_last=False) repeats up to world_size - 1 samples per epoch. Under
# 1% of the dataset this barely changes training; above it, duplicates are a visible share
# of every epoch (and of any evaluation metric computed over the sampler).
UNEVEN_WARN_FRACTION = 0.01

# Elements sampled from each parameter for the checksum. Different random inits or a
# checkpoint loaded on some ranks change every element, so a few dozen per tensor are
# plenty, and the cost stays one small gather per tensor whatever the model size.
CHECKSUM_SAMPLES = 64



_T = TypeVar("_T")


def _never_raise(default: Callable[[], _T]) -> Callable[[Callable[..., _T]], Callable[..., _T]]:
    """Public inspectors run inside the user's process: an unexpected object is no
    reason to break training, so any error yields the empty answer instead."""

    def wrap(fn: Callable[..., _T]) -> Callable[..., _T]:
        @functools.wraps(fn)
        def safe(*args: Any, **kwargs: Any) -> _T:
            try:
                return fn(*args, **kwargs)
            except Exception:
                return default()

        return safe

    return wrap


# --- start-of-run inspectors (agent side, torch imported lazily) --------------------------


def _is_ddp(module: Any) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(module, DistributedDataParallel)


@_never_raise(list)
def inspect_model(module: Any, world_size: int, rank: int = 0,
                  batch_size: int | None = None) -> list[Finding]:
    """Mistakes visible on the model object: nn.DataParallel, and (when the per-rank
    batch size is known) BatchNorm layers that normalise per rank over a small batch."""
    from torch import nn

    out: list[Finding] = []
    if isinstance(module, nn.DataParallel):
        n_dev = len(module.device_ids or ())
        if world_size > 1:
            out.append(finding(DATA_PARALLEL, (rank,),
                               f"nn.DataParallel in a job of {world_size} processes: gradients "
                               "are never averaged across processes, so ranks drift apart"))
        else:
            out.append(finding(DATA_PARALLEL, (rank,),
                               f"nn.DataParallel over {n_dev} device(s) in one process: one "
                               "Python thread per GPU under the GIL, replicas copied each step",
                               severity=WARNING))
    if batch_size is not None:
        out.extend(inspect_batchnorm(module, batch_size, world_size, rank))
    return out


@_never_raise(list)
def inspect_batchnorm(module: Any, batch_size: int, world_size: int,
                      rank: int = 0) -> list[Finding]:
    """BatchNorm layers in training mode, not SyncBatchNorm, with fewer than
    SMALL_BN_BATCH samples per rank: each rank normalises with its own noisy statistics.
    One process (world_size 1) has nothing to sync, so it never fires there."""
    from torch import nn
    from torch.nn.modules.batchnorm import _BatchNorm

    if world_size <= 1 or batch_size >= SMALL_BN_BATCH:
        return []
    kinds: Counter[str] = Counter(
        type(m).__name__ for m in module.modules()
        if isinstance(m, _BatchNorm) and not isinstance(m, nn.SyncBatchNorm) and m.training
    )
    if not kinds:
        return []
    layers = ", ".join(f"{name} x{n}" for name, n in sorted(kinds.items()))
    return [finding(BATCHNORM_NOT_SYNCED, (rank,),
                    f"{sum(kinds.values())} BatchNorm layers ({layers}) normalise over "
                    f"{batch_size} samples per rank (< {SMALL_BN_BATCH}) on {world_size} ranks")]


def _loader_parts(obj: Any) -> tuple[Any, Any, int | None, bool]:
    """(dataset, sampler, per-rank batch size, drop_last) of a DataLoader or of one of
    its iterators (the hooks see iterators, the user sees loaders)."""
    from torch.utils.data import BatchSampler, DataLoader

    if isinstance(obj, DataLoader):
        dataset, drop_last = obj.dataset, obj.drop_last
        index = obj.batch_sampler if obj.batch_sampler is not None else obj.sampler
    else:  # torch.utils.data.dataloader._BaseDataLoaderIter
        dataset, index, drop_last = obj._dataset, obj._index_sampler, obj._drop_last
    if isinstance(index, BatchSampler):
        return dataset, index.sampler, index.batch_size, index.drop_last
    # A custom batch sampler often wraps a sampler; batch_size=None loaders yield samples.
    batch = getattr(index, "batch_size", None)
    if type(batch) is not int:
        batch = None
    return dataset, getattr(index, "sampler", index), batch, drop_last


@_never_raise(list)
def inspect_loader(loader: Any, world_size: int, rank: int = 0) -> list[Finding]:
    """Mistakes visible on a training DataLoader (or its iterator): no DistributedSampler,
    a DistributedSampler built for another world or rank, padding of uneven shards, and a
    final partial batch. Iterable datasets shard themselves and are not judged."""
    from torch.utils.data import IterableDataset, RandomSampler, SequentialSampler
    from torch.utils.data.distributed import DistributedSampler

    dataset, sampler, batch, drop_last = _loader_parts(loader)
    if isinstance(dataset, IterableDataset):
        return []
    n = len(dataset)
    out: list[Finding] = []
    if isinstance(sampler, DistributedSampler):
        replicas, srank = sampler.num_replicas, sampler.rank
        if replicas != world_size or srank != rank:
            out.append(finding(SAMPLER_SHARD_MISMATCH, (rank,),
                               f"rank {rank} of {world_size} reads shard {srank} of "
                               f"{replicas} (DistributedSampler num_replicas/rank)"))
        padded = sampler.total_size - n
        if not sampler.drop_last and padded > 0:
            out.append(finding(UNEVEN_SHARDS, (rank,),
                               f"len(dataset)={n} is not divisible by {replicas} ranks: "
                               f"DistributedSampler repeats {padded} sample(s) per epoch "
                               f"({sampler.num_samples} per rank)",
                               severity=WARNING if padded / max(n, 1) >= UNEVEN_WARN_FRACTION
                               else INFO))
        per_rank = sampler.num_samples
    elif type(sampler) in (RandomSampler, SequentialSampler) and world_size > 1:
        # Only a hint from here: ranks that each built their own shard need no sampler.
        # The collector makes it critical when the data digests prove every rank reads
        # the same data, and drops it when they prove the opposite (judge/same_data.py).
        out.append(finding(NO_DISTRIBUTED_SAMPLER, (rank,),
                           f"{type(sampler).__name__} over all {n} samples on each of "
                           f"{world_size} ranks, no DistributedSampler",
                           severity=INFO))
        per_rank = n
    else:
        return out  # a custom sampler: its sharding is unknown, so say nothing
    if batch and not drop_last and per_rank % batch:
        out.append(finding(PARTIAL_FINAL_BATCH, (rank,),
                           f"{per_rank} samples per rank make {per_rank // batch} batches of "
                           f"{batch} and a last batch of {per_rank % batch}"))
    return out


def _checksum_tensor(module: Any) -> Any:
    """float64 sum of up to CHECKSUM_SAMPLES evenly strided elements of every floating
    parameter, as a 0-d tensor on the parameters' device (no host sync yet). None when
    there is nothing comparable: no parameters, meta tensors, or sharded parameters
    (FSDP holds a different shard on each rank, so their sums differ by design)."""
    import torch

    if any("FullyShardedDataParallel" in type(m).__name__ for m in module.modules()):
        return None
    parts = []
    for p in module.parameters():
        if type(p).__name__ == "DTensor" or p.device.type == "meta":  # FSDP2 / not built
            return None
        n = p.numel()
        if n and p.is_floating_point():
            parts.append(p.detach().reshape(-1)[:: -(-n // CHECKSUM_SAMPLES)])
    if not parts:
        return None
    with torch.no_grad():
        return torch.cat(parts).sum(dtype=torch.float64)


@_never_raise(lambda: None)
def param_checksum(module: Any) -> float | None:
    """A cheap fingerprint of the model's weights, for comparing ranks: equal weights
    give equal values. Reads the result on the host (one sync on GPU); the observer uses
    a non-blocking copy instead. None when there is nothing comparable."""
    total = _checksum_tensor(module)
    return None if total is None else float(total.item())


def _physical_cuda(index: int) -> str:
    """cuda:N as CUDA_VISIBLE_DEVICES names it (visible_devices.py: the one parser)."""
    return visible_devices.physical_name(index, visible_devices.from_env())


@_never_raise(lambda: None)
def device_key(module: Any) -> str | None:
    """The physical GPU holding the model's first parameter, comparable across ranks of
    one host: the GPU's UUID (immune to per-rank CUDA_VISIBLE_DEVICES), else its
    physical index. None on CPU, where sharing a device is not a mistake."""
    import torch

    p = next(module.parameters(), None)
    if p is None or p.device.type != "cuda":
        return None
    index = p.device.index if p.device.index is not None else torch.cuda.current_device()
    uuid = visible_devices.torch_uuid(torch, index)
    return f"GPU-{uuid}" if uuid else _physical_cuda(index)


def _capturing() -> bool:
    from .recorder import capturing

    return capturing()


class _PendingChecksum:
    """A checksum started on the training thread and read later without a GPU sync:
    on GPU the sum is copied to pinned memory behind a CUDA event, which the training
    thread polls at each optimizer step (`poll()`); `value` is None until then."""

    __slots__ = ("value", "host", "event")

    @staticmethod
    @_never_raise(lambda: None)
    def start(module: Any) -> _PendingChecksum | None:
        from .recorder import capturing

        if capturing():  # its kernels would be captured, its pinned allocation refused
            return None
        total = _checksum_tensor(module)
        return None if total is None else _PendingChecksum(total)

    def __init__(self, total: Any) -> None:
        self.value: float | None = None
        self.host: Any = None
        self.event: Any = None
        if total.device.type == "cuda":
            import torch

            # Under the weights' own device: the current device may be 0 in a script
            # that never called set_device, and nothing may open a context there.
            with torch.cuda.device(total.device):
                self.host = torch.empty((), dtype=torch.float64, pin_memory=True)
                self.host.copy_(total, non_blocking=True)
                self.event = torch.cuda.Event()
                self.event.record(torch.cuda.current_stream(total.device))
        else:
            self.value = float(total.item())

    def poll(self) -> float | None:
        """On the training thread only: a CUDA call from another thread would create a
        context on its current device (GPU 0). Never while a CUDA graph is captured
        anywhere in the process: an event query then invalidates the capture."""
        if self.value is None and self.event is not None and not _capturing() \
                and self.event.query():
            self.value = float(self.host.item())
        return self.value


# --- running observer (agent side, called by the hooks) ----------------------------------


# Root modules the observer remembers (weakly); the dead are dropped first.
MAX_MODELS = 16


def _dead() -> None:
    return None


def _ref(obj: Any) -> Callable[[], Any]:
    """A weak reference where the object allows one (generators do), else a strong one
    (an iterator over a list cannot be weakly referenced)."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj



class StepObserver:
    """Watches the running job through the calls the agent's hooks make, and reports each
    mistake once, when the evidence is conclusive.

    Hooks call (training thread):
      watch_model(module)   each root module, once, at its first forward (rare)
      on_loader_batch(it)   after every DataLoader __next__, with the iterator
      on_backward()         every backward pass that reaches the model's parameters
      on_optimizer_step()   after every optimizer.step(), of any optimizer
    The hooks write on_loader_batch and on_backward out inline (a Python call each saved
    per step, ~1k instructions): they set `last_iter`, and count `synced` while `sync_src`
    (a DDP module) is set, exactly as those methods do.
    The sender thread calls drain() for new findings and take_facts() for the values
    the collector compares across ranks.

    Per-step cost is a few attribute reads; the one-off checks (loader inspection at
    each new training epoch, BatchNorm at the first step, DDP's unused-parameter stats
    for FIND_UNUSED_STEPS steps) run off that fast path.
    """

    __slots__ = ("rank", "world_size", "error", "_off", "_findings", "_fired", "_models",
                 "_ddp", "sync_src", "last_iter", "_train_pass", "_samplers", "_batch",
                 "_bn_checked", "synced", "_accum_strikes", "_accum_max", "_unused_steps",
                 "_checksums", "_in_flight", "_device", "_stepped", "_facts_sent",
                 "digest", "_data", "_facts", "_digest_sent", "loader_len", "loader_epochs",
                 "loader_workers", "loader_persistent")

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.error: BaseException | None = None  # why the observer turned itself off
        self._off = False
        self._findings: deque[Finding] = deque()
        self._fired: set[str] = set()
        # The root modules and the DDP one, by weak reference: a model the script drops
        # must be freed (an HPO loop, k-fold, pretraining then fine-tuning).
        self._models: list[Callable[[], Any]] = []
        self._ddp: Callable[[], Any] = _dead
        # A weak reference to the DDP module on_backward reads; None once judged.
        self.sync_src: Callable[[], Any] | None = None
        self.last_iter: Any = None  # the iterator of the last batch, until the step ends
        self._train_pass: Callable[[], Any] = _dead  # ref to the training pass's _sampler_iter
        # Per sampler seen feeding steps, by id(): (ref to the sampler, ref to its current
        # pass, epoch at that pass, passes). Weak where possible, so a dataset the user
        # drops is not kept alive here; the sampler ref guards against a reused id().
        self._samplers: dict[int, tuple[Callable[[], Any], Callable[[], Any], int, int]] = {}
        self._batch: int | None = None
        self._bn_checked = False
        self.synced = 0  # synchronized backward passes since the last optimizer step
        self._accum_strikes = 0  # steps in a row with several synchronized backwards
        self._accum_max = 0
        self._unused_steps = -1  # steps of DDP unused-parameter evidence; -1: not checking
        self._checksums: list[_PendingChecksum] = []
        self._in_flight: list[_PendingChecksum] = []  # GPU copies not read yet
        self._device: str | None = None
        self._stepped = False  # a step has ended: every root module has been seen
        self._facts_sent = False
        # The first batches' digest (datadigest.py; the DataLoader hook feeds it while
        # `digest.left`), and the unsharded loader's dataset digest and sampler kind: the
        # collector's proof for no-distributed-sampler. Facts go again once the digest
        # is complete, if it was not at their first sending.
        self.digest = BatchDigest()
        if world_size <= 1:
            self.digest.left = 0
        self._data: dict[str, Any] = {"dataset_digest": None, "sampler": None}
        self._facts: dict[str, Any] | None = None
        self._digest_sent = False
        # The loader feeding the steps, for a stall's advice (heartbeat): its length in
        # batches, the passes over it (epochs), its workers and whether they persist.
        self.loader_len: int | None = None
        self.loader_epochs = 0
        self.loader_workers: int | None = None
        self.loader_persistent: bool | None = None

    # --- hooks' calls ----------------------------------------------------------------

    def watch_model(self, module: Any) -> None:
        """A root module (the DDP wrapper, a DataParallel, a bare model) at its first
        forward: inspect it, remember a DDP wrapper, start its weights' checksum."""
        if self._off:
            return
        try:
            if any(m() is module for m in self._models) \
                    or next(module.parameters(), None) is None:
                return
            self._models = [m for m in self._models if m() is not None][-MAX_MODELS + 1:]
            self._models.append(_ref(module))
            for f in inspect_model(module, self.world_size, self.rank):
                self._emit(f)
            if self._ddp() is None and _is_ddp(module):
                self._ddp = self.sync_src = _ref(module)
                if module.find_unused_parameters and not module.static_graph:
                    self._unused_steps = 0
            # The checksum compares the ranks' first weights: a model learned after the
            # facts went out (the next one of an HPO loop) is not summed.
            pending = None if self._facts_sent else _PendingChecksum.start(module)
            if pending is not None:
                self._checksums.append(pending)
                if pending.value is None:  # polled on this thread at the next steps
                    self._in_flight.append(pending)
            if self._device is None:
                self._device = device_key(module)
            self._check_batchnorm()
        except Exception as exc:
            self._fail(exc)

    def on_loader_batch(self, iterator: Any, batch: Any = None) -> None:
        """After each DataLoader __next__: remember which iterator fed the step, and
        digest the batch while the first ones are still to be read."""
        self.last_iter = iterator
        if self.digest.left:
            self.digest.add(batch)

    def on_backward(self) -> None:
        """Each backward pass. DDP decides at *forward* time whether the next backward
        allreduces: it sets `require_forward_param_sync` from `require_backward_grad_sync`
        (False inside no_sync()). Reading the forward-time flag also catches a forward run
        outside no_sync() with only the backward inside, which still synchronizes."""
        src = self.sync_src
        ddp = None if src is None else src()
        if ddp is not None:
            try:
                if ddp.require_forward_param_sync:
                    self.synced += 1
            except Exception as exc:
                self._fail(exc)

    def on_optimizer_step(self) -> None:
        """After each optimizer.step(): judge the step that just ended."""
        if self._off:
            return
        self._stepped = True
        try:
            it = self.last_iter
            if it is not None:
                self.last_iter = None  # hold no iterator (and its workers) past the step
                if it._sampler_iter is not self._train_pass():
                    self._new_training_pass(it)
            synced = self.synced
            if synced:
                self.synced = 0
                if synced > 1 or self._accum_strikes:  # one per step: nothing to judge
                    self._judge_accumulation(synced)
            if self._unused_steps >= 0:
                self._check_unused_parameters()
            if self._in_flight:  # GPU copies only: a CPU checksum is known at once
                self._in_flight = [p for p in self._in_flight if p.poll() is None]
        except Exception as exc:
            self._fail(exc)

    # --- sender thread -----------------------------------------------------------------

    def drain(self) -> list[Finding]:
        """Findings made since the last drain (thread-safe against the training thread)."""
        out = []
        while self._findings:
            out.append(self._findings.popleft())
        return out

    def take_facts(self) -> dict[str, Any] | None:
        """Once, when ready: this rank's values for the cross-rank checks, as a plain
        dict ({"param_checksum": float | None, "device": str | None, "batch_size": int |
        None}, the DataLoader's batch size, for samples/s); None before and
        after. Ready after the first optimizer step (the hooks have seen every root module
        by then) once every checksum has been read, which never waits on the GPU."""
        digested = self.digest.left <= 0
        if self._facts_sent:
            if self._digest_sent or not digested or self._facts is None:
                return None
            self._digest_sent = True  # the batches' digest, complete after the first facts
            return {**self._facts, "batch_digest": self.digest.value}
        if not self._stepped or not self._models:
            return None
        try:
            values = []
            for pending in self._checksums:
                value = pending.value  # read only: the training thread polls the GPU copy
                if value is None:
                    return None  # a GPU copy still in flight: ask again later
                values.append(value)
            self._facts_sent = True
            self._digest_sent = digested
            self._facts = {"param_checksum": math.fsum(values) if values else None,
                           "device": self._device, "batch_size": self._batch, **self._data}
            return {**self._facts, "batch_digest": self.digest.value if digested else None}
        except Exception as exc:
            self._fail(exc)
            return None

    # --- the one-off checks ------------------------------------------------------------

    def _new_training_pass(self, it: Any) -> None:
        """The iterator that fed this step is on a pass not seen at the last step: a new
        epoch, or a switch between loaders. Inspect each sampler once, and at each new
        pass over a shuffling DistributedSampler see whether its epoch moved on."""
        from torch.utils.data.distributed import DistributedSampler

        current = it._sampler_iter
        self._train_pass = _ref(current)
        _, sampler, batch, _ = _loader_parts(it)
        entry = self._samplers.get(id(sampler))
        if entry is None or entry[0]() is not sampler:  # first time: inspect the loader
            entry = (_ref(sampler), _dead, -1, 0)
            self._samplers[id(sampler)] = entry
            for f in inspect_loader(it, self.world_size, self.rank):
                if f.id == NO_DISTRIBUTED_SAMPLER and self._data["sampler"] is None:
                    self._data = {"dataset_digest": dataset_digest(it._dataset),
                                  "sampler": type(sampler).__name__}
                self._emit(f)
            if self._batch is None and batch:
                self._batch = batch
                self._check_batchnorm()
        if entry[1]() is current:
            return  # back to a pass already counted (another loader fed the last step)
        self._count_pass(it)
        if not isinstance(sampler, DistributedSampler) or not sampler.shuffle:
            # without shuffling every epoch has the same order anyway
            self._samplers[id(sampler)] = (entry[0], _ref(current), entry[2], entry[3])
            return
        passes = entry[3] + 1
        if passes > 1 and sampler.epoch == entry[2]:
            self._emit(finding(SET_EPOCH_NOT_CALLED, (self.rank,),
                               f"pass {passes} over the DistributedSampler started with "
                               f"epoch={sampler.epoch}, as did pass {passes - 1}: the same "
                               "sample order again"))
        self._samplers[id(sampler)] = (entry[0], _ref(current), sampler.epoch, passes)

    def _count_pass(self, it: Any) -> None:
        """A new pass over a loader (an epoch): its length and workers, for the advice."""
        self.loader_epochs += 1
        try:
            self.loader_len = len(it)
        except TypeError:  # an iterable dataset without a length
            self.loader_len = None
        workers = getattr(it, "_num_workers", None)
        self.loader_workers = workers if type(workers) is int and workers >= 0 else None
        persistent = getattr(it, "_persistent_workers", None)
        self.loader_persistent = persistent if type(persistent) is bool else None

    def _check_batchnorm(self) -> None:
        if self._bn_checked or self._batch is None or not self._models:
            return
        self._bn_checked = True
        for module in (m() for m in self._models):
            if module is None:
                continue
            for f in inspect_batchnorm(module, self._batch, self.world_size, self.rank):
                self._emit(f)

    def _judge_accumulation(self, synced: int) -> None:
        """Several synchronized backward passes before one optimizer step: each one
        allreduced every gradient, though only the last allreduce was needed."""
        if synced < 2:
            self._accum_strikes = self._accum_max = 0
            return
        self._accum_strikes += 1
        self._accum_max = max(self._accum_max, synced)
        if self._accum_strikes >= ACCUMULATION_CONFIRM_STEPS:
            per_step = self._accum_max
            self.sync_src = None  # said once: stop counting
            self._emit(finding(ACCUMULATION_WITHOUT_NO_SYNC, (self.rank,),
                               f"{per_step} backward passes per optimizer step each allreduced "
                               f"all gradients ({self._accum_strikes} steps in a row): "
                               f"{per_step - 1} of every {per_step} allreduces wasted"))

    def _check_unused_parameters(self) -> None:
        """find_unused_parameters=True makes DDP traverse the autograd graph every
        iteration. DDP's own logger records the unused parameters' bytes for its first 10
        iterations; none in any of them means the flag only costs time (~7 us to read,
        on the host: no GPU sync)."""
        ddp = self._ddp()
        if ddp is None:  # the DDP module was dropped: nothing left to judge
            self._unused_steps = -1
            return
        stats = ddp._get_ddp_logging_data()
        unused = stats.get("unused_parameter_size")
        if unused is None:
            return  # no sampled iteration yet
        self._unused_steps += 1
        if unused:
            self._unused_steps = -1  # the flag is needed: stop looking
        elif self._unused_steps >= FIND_UNUSED_STEPS:
            self._unused_steps = -1
            self._emit(finding(FIND_UNUSED_UNNEEDED, (self.rank,),
                               f"find_unused_parameters=True, but DDP found 0 unused "
                               f"parameters in each of {FIND_UNUSED_STEPS} iterations "
                               f"(iteration {stats.get('iteration')}); each pays a graph walk"))

    def _emit(self, f: Finding) -> None:
        if f.id not in self._fired:
            self._fired.add(f.id)
            self._findings.append(f)

    def _fail(self, exc: BaseException) -> None:
        """An observer bug must not become the user's problem: stop observing."""
        self.error = exc
        self._off = True
        self._ddp, self.sync_src = _dead, None
        self._unused_steps = -1


# The facts' optional keys: the batch size, and the data digests and sampler kind.
